"""Writing FP8 block-scaled weights: the quantization arithmetic, and how a quantized output is written
(quantized_steps.py applies it to a mapping's steps).

The arithmetic is transformers' own (`transformers.integrations.finegrained_fp8.Fp8Quantize._quantize_one`), so
the bytes are those transformers writes: per block of [b0, b1] elements of the last two dims, in float32,
`scale = 448 / amax` (1 for an all-zero block), `weight_scale_inv = 1 / scale`, and the weight
`clamp(w * scale, -448, 448)` cast to float8_e4m3fn. With `scale_fmt: "ue8m0"` the inverse scale is first
rounded up to a power of two (through float8_e8m0fnu, as transformers does) and the weight multiplied by its
exact reciprocal; a release that stores such scales as e8m0 bytes (transformers' `mxfp8`: uint8, 2^(byte - 127))
gets that float8_e8m0fnu's byte, as transformers' MXFP8 checkpoints hold it. transformers skips shapes that are
not whole blocks; releases such as DeepSeek-V3's have partial edge blocks (a scale grid of ceil(rows / b0) x
ceil(cols / b1)), quantized here as if padded with zeros, which changes no block's amax. The work goes one band
of block rows at a time (fp8.py's band_rows: about 4M elements), so beside the tensor only a band's float32 copy
is held; every operation is per element or per block, so the bytes are those of the whole tensor.

A quantized output is written from the whole tensor at its writer: the step that makes it becomes a transform
(its pieces are assembled there, within the batch budget like any transform's), and a block's amax never spans
ranks.

`--quantize_like` keeps the release's bytes for each block whose values training left unchanged
(release_blocks.py): transformers' ue8m0 rule is not a fixed point (a block whose largest code is 224 comes back
with its scale halved and its codes doubled), so quantizing the release's own values again would change them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8 import E8M0_BYTES, band_rows, dequantize, scale_shape
from .quantized_check import E4M3_HALF_STEP
from .quantized_formats import SCALE_SUFFIX
from .release_blocks import StoredTensor, as_read, keep, per_element, unchanged_blocks
from .steps import OutputSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE_DTYPE = torch.float32


def quantize(block: tuple[int, int], ue8m0: bool, tensor: torch.Tensor, scale_dtype: torch.dtype = SCALE_DTYPE
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, weight_scale_inv per block) of `tensor` ([..., rows, cols]); the scales float32, or
    `scale_dtype` E8M0_BYTES (with `ue8m0` only) their e8m0 bytes."""
    b0, b1 = block
    rows, cols = tensor.shape[-2:]
    lead = tensor.shape[:-2]
    grid = scale_shape(tuple(tensor.shape), block)
    quantized = torch.empty(tensor.shape, dtype=FP8)
    scale_inv = torch.empty(grid, dtype=scale_dtype)
    step = band_rows(tuple(tensor.shape), block)
    for first in range(0, grid[-2], step):
        k = min(step, grid[-2] - first)  # block rows in this band
        band = tensor[..., first * b0:(first + k) * b0, :].to(torch.float32)
        n = band.shape[-2]
        band = F.pad(band, (0, grid[-1] * b1 - cols, 0, k * b0 - n))  # zeros: no block's amax changes
        blocks = band.reshape(*lead, k, b0, grid[-1], b1)
        max_abs = blocks.abs().amax(dim=(-3, -1))
        safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
        scales = FP8_MAX / safe_max_abs
        scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
        inv = (1.0 / scales).to(torch.float32)
        if ue8m0:
            inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
            inv = inv.to(torch.float8_e8m0fnu)
            scales = 1.0 / inv.to(torch.float32)
        q = torch.clamp(blocks * scales.unsqueeze(-1).unsqueeze(-3), min=-FP8_MAX, max=FP8_MAX).to(FP8)
        quantized[..., first * b0:first * b0 + n, :] = q.reshape(band.shape)[..., :n, :cols]
        scale_inv[..., first:first + k, :] = inv.view(E8M0_BYTES) if scale_dtype == E8M0_BYTES else inv.to(SCALE_DTYPE)
    return quantized, scale_inv


def quantize_keeping(block: tuple[int, int], ue8m0: bool, tensor: torch.Tensor, scale_dtype: torch.dtype,
                     release: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(), but each block whose values are the `release`'s (its weight and scale, dequantized and cast to
    `tensor`'s dtype: what reading the release gave) keeps the release's codes and scale."""
    codes, scales = release
    (values,) = dequantize(block, [codes, scales])
    grid = unchanged_blocks(as_read(values, tensor), block)
    if grid.all():  # nothing changed: no quantizing
        return codes.to(FP8), scales.to(scale_dtype)
    new_codes, new_scales = quantize(block, ue8m0, tensor, scale_dtype)
    return keep(per_element(grid, block, tensor.shape), codes, new_codes), keep(grid, scales, new_scales)


@dataclass(frozen=True)
class Fp8Output:
    """How an FP8 output is written: which outputs are quantized (by name), in which blocks and scale format,
    the dtypes the other tensors take (a release's own; absent: the policy's), config.json's quantization_config,
    the scales' dtype (float32, or E8M0_BYTES as transformers' mxfp8 stores them), and `--quantize_like`'s release,
whose bytes unchanged blocks keep (None: every block quantized)."""

    block: tuple[int, int]
    ue8m0: bool
    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    scale_dtype: torch.dtype = SCALE_DTYPE
    release: dict[str, StoredTensor] | None = None

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and len(spec.shape) >= 2

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        # a slab of stacked experts [k, rows, cols] (spec.rows: only experts are written in slabs, and blocks lie in
        # the last two dims) has the same experts' slab of the scales
        return (dataclasses.replace(spec, dtype=FP8),
                OutputSpec(spec.name + SCALE_SUFFIX, scale_shape(spec.shape, self.block), self.scale_dtype,
                           rows=spec.rows))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        if self.release is None:
            return list(quantize(self.block, self.ue8m0, tensor, self.scale_dtype))
        stored = (self.release[spec.name].read(spec.rows), self.release[spec.name + SCALE_SUFFIX].read(spec.rows))
        return list(quantize_keeping(self.block, self.ue8m0, tensor, self.scale_dtype, stored))

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        codes, scales = parts
        return (dequantize(self.block, [codes, scales])[0],
                dequantize(self.block, [torch.full_like(codes, E4M3_HALF_STEP), scales])[0])
