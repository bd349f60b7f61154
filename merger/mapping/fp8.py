"""FP8 block-scaled HF releases (DeepSeek-V3/R1, Qwen3-FP8, ...) written back as a plain model.

Such a release stores each quantized weight `W` as float8 beside `W_scale_inv` (`<module>.weight_scale_inv`):
one float per block of `weight_block_size` [b0, b1] elements of the last two dims, the factor that turns the
stored values back into the weight: w[i, j] = q[i, j] * scale_inv[i // b0, j // b1]. The last block of a row
or column may be partial, so the scale grid is ceil(rows / b0) x ceil(cols / b1). config.json names the
scheme in `quantization_config` (`quant_method: "fp8"`, transformers' FineGrainedFP8Config). With `scale_fmt:
"ue8m0"` a scale may be stored as its e8m0 exponent byte (uint8, 2^(byte - 127)): transformers' `mxfp8`
(`quant_method: "mxfp8"`, blocks of [1, 32]) stores them so; a uint8 scale is refused under any other config.
DeepSeek-V4 stores its scales as float8_e8m0fnu (the same powers of two, as a dtype) and, under `expert_dtype:
"fp4"`, its routed experts as FP4: int8 (or torch's float4_e2m1fn_x2, safetensors' F4: the same bytes) [rows,
cols / 2] of two e2m1 codes a byte, the even element in the low
nibble, in blocks of [1, 32] of the unpacked weight whatever `weight_block_size` says, as transformers'
`Fp8Dequantize` reads them (it takes each tensor's block from its scale grid).

Each quantized weight is one step reading the weight and its scale (both small: one byte per weight element),
dequantized in float32 where it is written; the policy then casts it to --dtype. Tensors without a scale
(norms, embeddings, modules_to_not_convert) are cast as usual. `quantization_config` leaves config.json: the
output holds no quantized weight. Under `--dtype keep` the dequantized weights are written in float32, the
dtype the dequantization computes in (so `merger test` compares them with a reference in its own dtype);
float8 is written again only by --quantize_like (fp8_quantize.py). A LoRA folded into such a release reads its
weights through the same steps (`release_steps`: lora/quantized_base.py).
"""
from __future__ import annotations

from functools import partial
from math import prod

import torch

from ..catalog import Catalog, SourceTensor
from ..errors import MergerError
from ..options import MergeOptions
from ..safetensors_io import FP4_X2
from .compressed_tensors_codec import e8m0, fp4_values
from .hf import model_config
from .quantized_formats import (FP8_BLOCK, MXFP8, QUANTIZATION_CONFIG, SCALE_SUFFIX, fp4_experts, fp8_block_config,
                                stored_format, unquantized_note)
from .saved_names import rename_outputs, saved_names
from .steps import DEQUANTIZED, FLOAT8, Mapping, OutputSpec, Step, cast

E8M0_BYTES = torch.uint8  # a ue8m0 scale stored as its exponent byte
FP4_PAIRS = torch.int8  # DeepSeek-V4's FP4 experts: two e2m1 codes a byte
FP4_STORED = (FP4_PAIRS, *((FP4_X2,) if FP4_X2 is not None else ()))  # or the same bytes as torch's FP4 dtype
FP4_BLOCK = (1, 32)
BAND_ELEMENTS = 1 << 22  # about how many elements one band of the block-wise work takes (16 MiB in float32)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """HF names stored as an FP8 block-scaled release. Asked before plain HF names, so this is where a HF-named
    checkpoint's quantized format is decided (quantized_formats.py): one merger does not read is refused here."""
    if catalog.naming != "hf" or options.model not in ("auto", "hf"):
        return False
    try:
        hf_dir, config = model_config(catalog, options)
    except MergerError:
        return False  # no config: no FP8 release; the hf mapper says what is missing
    return stored_format(hf_dir, config, catalog.tensors) == FP8_BLOCK


def band_rows(shape: tuple[int, ...], block: tuple[int, int]) -> int:
    """How many block rows one band of the work on a tensor of `shape` takes: one at least, and as many as keep a
    band near BAND_ELEMENTS (blocks of 1x32 a row at a time would be one Python step per row)."""
    per_block_row = block[0] * -(-shape[-1] // block[1]) * block[1] * max(1, prod(shape[:-2]))
    return max(1, BAND_ELEMENTS // per_block_row)


def dequantize(block: tuple[int, int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[weight, scale_inv] -> [weight * scale_inv of its block] in float32, one band of block rows at a time (in
    place: beside the float32 result only one band's scales are held). A uint8 scale is e8m0 bytes (_check_scale
    lets one through only under scale_fmt ue8m0): exact powers of two, so each product is exact."""
    weight, scale = tensors
    if scale.dtype == E8M0_BYTES:
        scale = e8m0(scale)
    b0, b1 = block
    out = fp4_values(weight.view(torch.uint8)) if weight.dtype in FP4_STORED else weight.to(DEQUANTIZED)
    cols = out.shape[-1]
    step = band_rows(tuple(out.shape), block)
    for first in range(0, scale.shape[-2], step):
        band = out[..., first * b0:(first + step) * b0, :]
        band_scale = (scale[..., first:first + step, :].to(DEQUANTIZED).repeat_interleave(b1, dim=-1)[..., :cols]
                      .repeat_interleave(b0, dim=-2)[..., :band.shape[-2], :])
        band.mul_(band_scale)
    return [out]


def block_size(qc: dict, where) -> tuple[int, int]:
    block = qc["weight_block_size"]
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MergerError(f"quantization_config.weight_block_size is {block!r}, not two positive integers, {where}")
    return block[0], block[1]


def ue8m0_scales(qc: dict) -> bool:
    """Whether the config says the scales are powers of two, which may then be stored as e8m0 bytes."""
    return qc.get("scale_fmt") == "ue8m0"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def weight_block(weight: SourceTensor, block: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(the shape of quantized `weight` as a weight, its block): FP4 pairs unpacked in blocks of FP4_BLOCK; FP8 as
    stored, in the config's `block`."""
    if weight.dtype in FP4_STORED:
        return (*weight.shape[:-1], 2 * weight.shape[-1]), FP4_BLOCK
    return weight.shape, block


def _check_scale(name: str, tensors: dict[str, SourceTensor], block: tuple[int, int], ue8m0: bool,
                 fp4: bool = False) -> SourceTensor:
    """The scale of quantized weight `name`, checked against it (`ue8m0`: the config's scale_fmt, which makes a
    uint8 scale e8m0 bytes; `fp4`: the config's expert_dtype is fp4, which makes an int8 weight FP4 pairs)."""
    weight, scale = tensors[name], tensors[name + SCALE_SUFFIX]
    pairs = weight.dtype in FP4_STORED
    if not (fp4 and pairs) and (weight.dtype not in FLOAT8 or pairs):
        raise MergerError(f"tensor {name} has a block scale but is stored as {str(weight.dtype).removeprefix('torch.')}"
                          f", not float8{' nor as FP4 pairs (int8, float4_e2m1fn_x2)' if fp4 else ''}, {weight.file}")
    shape, block = weight_block(weight, block)
    if len(shape) < 2 or scale.shape != scale_shape(shape, block):
        want = list(scale_shape(shape, block)) if len(shape) >= 2 else "a weight of 2 dims or more"
        raise MergerError(f"scale {scale.name} is {list(scale.shape)}, but weight {name} {list(shape)} in "
                          f"blocks of {block[0]}x{block[1]} needs {want}, {scale.file}")
    if not scale.dtype.is_floating_point and not (ue8m0 and scale.dtype == E8M0_BYTES):
        raise MergerError(f"scale {scale.name} is stored as {str(scale.dtype).removeprefix('torch.')}, not as "
                          f"floats{' nor as e8m0 bytes (uint8)' if ue8m0 else ''}, {scale.file}")
    return scale


def _dequantize_step(name: str, tensors: dict[str, SourceTensor], block: tuple[int, int], ue8m0: bool,
                     fp4: bool) -> Step:
    scale = _check_scale(name, tensors, block, ue8m0, fp4)
    shape, block = weight_block(tensors[name], block)
    return Step((name, scale.name), (OutputSpec(name, shape, DEQUANTIZED),), partial(dequantize, block))


def release_steps(names: dict[str, SourceTensor], qc: dict, where) -> list[Step]:
    """The steps writing a release's tensors `names` (its quantization_config `qc`, in file `where`): each quantized
    weight dequantized from it and its scale, every other tensor cast, no scale written."""
    block, ue8m0, fp4 = block_size(qc, where), ue8m0_scales(qc), fp4_experts(qc)
    steps = []
    for name, t in names.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in names:
                raise MergerError(f"scale {name} has no weight {name.removesuffix(SCALE_SUFFIX)} beside it, {t.file}")
        elif name + SCALE_SUFFIX in names:
            steps.append(_dequantize_step(name, names, block, ue8m0, fp4))
        elif t.dtype in FLOAT8:
            raise MergerError(f"tensor {name} is stored as {str(t.dtype).removeprefix('torch.')} with no "
                              f"{name + SCALE_SUFFIX} beside it, {t.file}")
        else:
            steps.append(cast(name, name, t.shape, t.dtype))
    return steps


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    qc = fp8_block_config(config)
    block = block_size(qc, hf_dir / "config.json")
    names = catalog.tensors
    steps = release_steps(names, qc, hf_dir / "config.json")
    count = sum(not s.is_cast for s in steps)
    scheme = f"{MXFP8}: " if qc["quant_method"] == MXFP8 else ""
    e8m0_bytes = any(t.dtype == E8M0_BYTES for n, t in names.items() if n.endswith(SCALE_SUFFIX))
    pairs = sum(names[s.inputs[0]].dtype in FP4_STORED for s in steps if not s.is_cast)
    note = (f"merger: FP8 block-scaled weights ({scheme}block {block[0]}x{block[1]}"
            f"{', e8m0 scales' if e8m0_bytes else ''}), {count} tensors dequantized"
            f"{f' ({pairs} of them FP4 experts, e2m1 in blocks of 1x32)' if pairs else ''}; {QUANTIZATION_CONFIG} "
            f"left out of config.json")
    kept = [name for name in names if not name.endswith(SCALE_SUFFIX)]
    return Mapping(rename_outputs(steps, saved_names(hf_dir, config, kept, options.trust_remote_code)), hf_dir,
                   config, config_removals=(QUANTIZATION_CONFIG,),
                   notes=(note, unquantized_note([s.inputs[0] for s in steps if s.is_cast])))
