"""`--quantize_like` a compressed-tensors `mxfp4-pack-quantized` release (llmcompressor's MXFP4A16): the output
written as the release stores its weights, quantized by compressed-tensors' own rule.

A quantized weight `<m>.weight` [out, in] is stored as `<m>.weight_packed` uint8 [out, in / 2] (two e2m1 codes a
byte, the even element in the low nibble: compressed_tensors_codec.py reads them) and `<m>.weight_scale` uint8
[out, in / 32], an e8m0 byte per group of 32.

The rule is compressed-tensors 0.20's (`calculate_qparams` with `generate_mx_scales`, then its compressor's
`quantize` and `pack_fp4_to_uint8`), on the weight at --dtype: the group's scale byte by the MX rule MXFP8 uses
(mxfp8_release_layout.compressed_tensors_scales), with e2m1's offset 2 (floor(log2 6)); each element w / scale
(exact: a power of two) clamped to ±6, so that a group whose amax rounded down saturates its largest elements at 6,
and rounded to the nearest e2m1 magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}, a tie to the even code (0.25 -> 0, 0.75 ->
1, 2.5 -> 2, 5 -> 4); the sign bit is set for a negative weight, also where it rounds to 0 (-0), and not for -0.0
itself. Groups whose values are the release's own keep the release's bytes (release_blocks.py): the rule is no
fixed point, and a release's -0 codes are not the rule's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..hf_folder import read_config
from .compressed_tensors_codec import mxfp4
from .e2m1_pack import pack_e2m1
from .fp8_release_layout import packed_release, readable
from .mxfp8_release_layout import compressed_tensors_scales
from .quantized_check import E2M1_HALF_STEP
from .quantized_formats import QUANTIZATION_CONFIG
from .release_blocks import StoredTensor, as_read, keep, unchanged_blocks
from .steps import OutputSpec

MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
GROUP = 32
E2M1_OFFSET = 2
ONES = 0x22  # a byte of two codes of 1.0: times the scales, the group's scale at each element
PACKED, SCALE = "_packed", "_scale"  # `<m>.weight` -> `<m>.weight_packed`, `<m>.weight_scale`


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [..., n / 2], e8m0 scale bytes [..., n / 32]) of `weight` by compressed-tensors' rule."""
    groups = weight.to(torch.float32).unflatten(-1, (-1, GROUP))  # exact: every --dtype is float32's subset
    scales, factor = compressed_tensors_scales(groups, E2M1_OFFSET)
    return pack_e2m1((groups / factor).flatten(-2)), scales


@dataclass(frozen=True)
class Mxfp4PackOutput:
    """How an mxfp4-pack-quantized output is written: which outputs are quantized (by name), the dtypes the other
    tensors take (the release's), config.json's quantization_config (the release's), and the release's tensors,
    whose bytes unchanged groups keep (None: a Hub id's, every group quantized)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    release: dict[str, StoredTensor] | None = None

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and spec.rows is None

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        out, cols = spec.shape
        return (OutputSpec(spec.name + PACKED, (out, cols // 2), torch.uint8),
                OutputSpec(spec.name + SCALE, (out, cols // GROUP), torch.uint8))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        if self.release is None:
            return list(quantize(tensor))
        packed, scales = (self.release[spec.name + part].read() for part in (PACKED, SCALE))
        grid = unchanged_blocks(as_read(mxfp4(packed, scales), tensor), (1, GROUP))
        if grid.all():  # nothing changed: no quantizing
            return [packed, scales]
        new_packed, new_scales = quantize(tensor)
        pairs = grid.repeat_interleave(GROUP // 2, dim=-1)  # a group is 16 bytes
        return [keep(pairs, packed, new_packed), keep(grid, scales, new_scales)]

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        packed, scales = parts
        return mxfp4(packed, scales), mxfp4(torch.full_like(packed, ONES), scales) * E2M1_HALF_STEP


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]]) -> Mxfp4PackOutput:
    """How to write `outputs` (name -> shape) as the mxfp4-pack-quantized release in `folder` (its scheme checked by
    config_format) stores them."""
    tensors, here, dtypes = packed_release(folder, outputs, (PACKED, SCALE), 2, GROUP)
    return Mxfp4PackOutput(here, dtypes, read_config(folder)[QUANTIZATION_CONFIG], readable(tensors))
