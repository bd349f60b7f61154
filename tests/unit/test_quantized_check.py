"""--verify's read-back of a quantized output (merger/mapping/quantized_check.py), for each layout merger writes:
what the layout's quantizer writes (the producing tool's bytes, tested in test_fp8_write, test_mxfp4_write,
test_compressed_tensors_write, test_compressed_tensors_nvfp4_write, test_modelopt_write and test_deepseek_v4_write)
reads back within the format's bound of the weight, outliers and all-zero groups included; the same bytes with one
group's scale doubled (a bug of the kind that --verify's byte comparison cannot see) do not."""
from __future__ import annotations

import pytest
import torch

from merger.errors import MergerError
from merger.mapping.fp8_quantize import Fp8Output
from merger.mapping.int4_release_layout import Int4Output
from merger.mapping.mxfp4_pack_release_layout import Mxfp4PackOutput
from merger.mapping.mxfp4_quantize import Mxfp4Output
from merger.mapping.mxfp8_release_layout import Mxfp8Output, compressed_tensors_quantize, modelopt_quantize
from merger.mapping.nvfp4_release_layout import MODELOPT, Nvfp4Output
from merger.mapping.quantized_check import check
from merger.mapping.steps import OutputSpec

pytestmark = pytest.mark.unit

NAME = "model.layers.0.mlp.down_proj.weight"
LAYOUTS = {
    "fp8 128x128": (Fp8Output((128, 128), False, frozenset({NAME}), {}, {}), (256, 384)),
    "fp8 ue8m0": (Fp8Output((128, 128), True, frozenset({NAME}), {}, {}), (256, 384)),
    "transformers mxfp8": (Fp8Output((1, 32), True, frozenset({NAME}), {}, {}, scale_dtype=torch.uint8), (64, 96)),
    "deepseek-v4 fp8": (Fp8Output((128, 128), True, frozenset({NAME}), {}, {}, scale_dtype=torch.float8_e8m0fnu),
                        (256, 384)),
    "deepseek-v4 fp4 experts": (Fp8Output((128, 128), True, frozenset({NAME}), {}, {},
                                          scale_dtype=torch.float8_e8m0fnu, fp4=frozenset({NAME})), (64, 96)),
    "compressed-tensors mxfp8": (Mxfp8Output(frozenset({NAME}), {}, {}, "compressed-tensors",
                                             compressed_tensors_quantize), (64, 96)),
    "modelopt mxfp8": (Mxfp8Output(frozenset({NAME}), {}, {}, "ModelOpt", modelopt_quantize), (64, 96)),
    "int4 bf16 scales": (Int4Output(frozenset({NAME}), {}, {}, torch.bfloat16), (64, 96)),
    "int4 fp32 scales": (Int4Output(frozenset({NAME}), {}, {}, torch.float32), (64, 96)),
    "gpt-oss mxfp4": (Mxfp4Output(frozenset({NAME}), {}, {}), (2, 64, 96)),  # [E, in, out]
    "compressed-tensors mxfp4": (Mxfp4PackOutput(frozenset({NAME}), {}, {}), (64, 96)),
    "compressed-tensors nvfp4": (Nvfp4Output(frozenset({NAME}), {}, {}), (64, 96)),
    "modelopt nvfp4": (Nvfp4Output(frozenset({NAME}), {}, {}, MODELOPT), (64, 96)),
}


def _weight(shape: tuple[int, ...]) -> torch.Tensor:
    """Normal weights at a typical scale, with outliers, an exact zero group, and both signs of zero."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=generator) * 0.02
    w.view(-1)[::97] *= 40  # outliers: the largest magnitudes of their groups
    w.view(-1)[:64] = 0.0
    w.view(-1)[64:66] = -0.0
    return w.bfloat16()


def _doubled_scale(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`parts` with the scale of the weight's last group or block doubled (an e8m0 byte: one more)."""
    parts = [p.clone() for p in parts]
    scale = parts[1].view(-1)
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        scale.view(torch.uint8)[-1] += 1
    elif scale.dtype == torch.float8_e4m3fn:  # no arithmetic in float8
        scale[-1] = (scale[-1].float() * 2).to(scale.dtype)
    else:
        scale[-1] *= 2
    return parts


@pytest.mark.parametrize("layout, shape", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_what_the_quantizer_writes_reads_back_within_its_bound_and_a_doubled_scale_does_not(layout, shape):
    weight = _weight(shape)
    spec = OutputSpec(NAME, shape, torch.bfloat16)
    parts = layout.quantize(weight, spec)
    values, bound = layout.read_back(parts, spec)
    assert values.shape == weight.shape == bound.shape
    check(NAME, "the format", weight, values, bound)
    # the bound is no wider than the format's: some element of the outliers' groups comes within 10x of it
    assert ((weight.float() - values).abs() / bound).max() > 0.1
    with pytest.raises(MergerError, match=f"^--verify: {NAME}, quantized as the format, reads back"):
        check(NAME, "the format", weight, *layout.read_back(_doubled_scale(parts), spec))
