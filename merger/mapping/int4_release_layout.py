"""`--quantize_like` a compressed-tensors INT4 `pack-quantized` release (Kimi-K2-Thinking's scheme: symmetric
int4 in groups of 32, compressed_tensors_scheme.py checks it): the output written as the release stores its weights,
quantized by compressed-tensors' own rule.

A quantized weight `<m>.weight` [out, in] is stored as `<m>.weight_packed` int32 [out, in / 8] (eight codes a word,
element i at bits 4i..4i+3, each the signed code plus 8), `<m>.weight_scale` [out, in / 32] in the release's dtype
(bfloat16: the model's, as compressed-tensors keeps it) and `<m>.weight_shape` int64 [2], the weight's shape.

The rule is compressed-tensors 0.20's (`calculate_qparams`, then its compressor's `quantize` and `pack_to_int32`),
computed in the scale's dtype as compressed-tensors computes on a model loaded in it: per group, amax =
max(|min(w, 0)|, max(w, 0)), scale = amax / 7.5 (an all-zero group: the dtype's eps), each code
round(clamp(w / scale, -8, 7)) (half to even). Neither step is exact in bfloat16, and 7.5 is no power of two: a
group read back (codes times scale) and quantized again gets the scale 7/7.5 or 8/7.5 of its own, so groups whose
values are the release's keep the release's bytes (release_blocks.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MergerError
from ..hf_folder import read_config
from .compressed_tensors_codec import INT4_OFFSET, INT4_SHIFTS, int4
from .fp8_release_layout import packed_release, readable
from .quantized_check import int4_half_step
from .quantized_formats import QUANTIZATION_CONFIG
from .release_blocks import StoredTensor, as_read, keep, unchanged_blocks
from .steps import OutputSpec

PACK_QUANTIZED = "pack-quantized"
GROUP = 32
PER_WORD = 8
HALF_RANGE = 7.5  # (7 - (-8)) / 2
PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # `<m>.weight` -> `<m>.weight_packed`, ...


# A word of eight codes of +1 (offset nibbles 9), as int32: times the scales, the group's scale at each element
ONES = int.from_bytes(bytes([(1 + INT4_OFFSET) * 0x11] * 4), "little", signed=True)


def quantize(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 packed codes [out, in / 8], scales [out, in / 32] in `scale_dtype`) by compressed-tensors' rule, on the
    weight in `scale_dtype`."""
    groups = weight.to(scale_dtype).unflatten(-1, (-1, GROUP))
    amax = torch.maximum(groups.amin(-1).clamp(max=0).abs(), groups.amax(-1).clamp(min=0))
    scales = amax / torch.tensor(HALF_RANGE, dtype=scale_dtype)
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype), scales)
    codes = torch.round(torch.clamp(groups / scales.unsqueeze(-1), -INT4_OFFSET, INT4_OFFSET - 1))
    nibbles = (codes.flatten(-2).to(torch.int64) + INT4_OFFSET).unflatten(-1, (-1, PER_WORD))
    words = (nibbles << INT4_SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32), scales  # two's complement


@dataclass(frozen=True)
class Int4Output:
    """How an INT4 pack-quantized output is written: which outputs are quantized (by name), the dtypes the other
    tensors take (the release's), config.json's quantization_config (the release's), the scales' dtype, and the
    release's tensors, whose bytes unchanged groups keep (None: a Hub id's, every group quantized)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    scale_dtype: torch.dtype
    release: dict[str, StoredTensor] | None = None

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and spec.rows is None

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        out, cols = spec.shape
        return (OutputSpec(spec.name + PACKED, (out, cols // PER_WORD), torch.int32),
                OutputSpec(spec.name + SCALE, (out, cols // GROUP), self.scale_dtype),
                OutputSpec(spec.name + SHAPE, (2,), torch.int64))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        shape = torch.tensor(tensor.shape, dtype=torch.int64)
        if self.release is None:
            return [*quantize(tensor, self.scale_dtype), shape]
        packed, scales = (self.release[spec.name + part].read() for part in (PACKED, SCALE))
        grid = unchanged_blocks(as_read(int4(packed, scales), tensor), (1, GROUP))
        if grid.all():  # nothing changed: no quantizing
            return [packed, scales, shape]
        new_packed, new_scales = quantize(tensor, self.scale_dtype)
        words = grid.repeat_interleave(GROUP // PER_WORD, dim=-1)  # a group is 4 words
        return [keep(words, packed, new_packed), keep(grid, scales, new_scales), shape]

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        packed, scales, _ = parts
        return int4(packed, scales), int4(torch.full_like(packed, ONES), scales) * int4_half_step(self.scale_dtype)


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]]) -> Int4Output:
    """How to write `outputs` (name -> shape) as the pack-quantized release in `folder` (its scheme checked by
    config_format) stores them."""
    tensors, here, dtypes = packed_release(folder, outputs, (PACKED, SCALE, SHAPE), PER_WORD, GROUP)
    scale_dtypes = {t.dtype for name, t in tensors.items()
                    if name.endswith(SCALE) and name.removesuffix(SCALE) + PACKED in tensors}
    if len(scale_dtypes) != 1:
        raise MergerError(f"the release stores its INT4 scales in {len(scale_dtypes)} dtypes: --quantize_like writes "
                          f"them in one, {folder}")
    return Int4Output(here, dtypes, read_config(folder)[QUANTIZATION_CONFIG], scale_dtypes.pop(),
                      readable(tensors))
