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

A DeepSeek-V4 release (`expert_dtype: "fp4"`) stores its routed experts as FP4 pairs with a scale per block of 1x32,
beside its FP8 weights, every scale float8_e8m0fnu: those experts are quantized by DeepSeek's FP4 rule
(fp4_experts_quantize.py) and their unchanged blocks kept the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from . import fp4_experts_quantize
from .fp8 import E8M0_BYTES, FP4_BLOCK, FP4_PAIRS, band_rows, dequantize, scale_shape
from .mxfp4_quantize import ONES
from .quantized_check import E2M1_HALF_STEP, E4M3_HALF_STEP
from .quantized_formats import SCALE_SUFFIX
from .release_blocks import StoredTensor, as_read, keep, per_element, unchanged_blocks
from .steps import OutputSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE_DTYPE = torch.float32


def quantize(block: tuple[int, int], ue8m0: bool, tensor: torch.Tensor, scale_dtype: torch.dtype = SCALE_DTYPE
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, weight_scale_inv per block) of `tensor` ([..., rows, cols]); the scales float32, or
    (with `ue8m0` only) as `scale_dtype` float8_e8m0fnu or E8M0_BYTES, their e8m0 bytes."""
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
        scale_inv[..., first:first + k, :] = inv.view(E8M0_BYTES) if scale_dtype == E8M0_BYTES else inv.to(scale_dtype)
    return quantized, scale_inv


def quantize_keeping(block: tuple[int, int], tensor: torch.Tensor, release: tuple[torch.Tensor, torch.Tensor],
                     rule: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rule`(tensor) (FP8's quantize, or FP4's for DeepSeek-V4's experts), but each block whose values are the
    `release`'s (its codes and scales, dequantized and cast to `tensor`'s dtype: what reading the release gave)
    keeps the release's codes and scale."""
    codes, scales = release
    (values,) = dequantize(block, [codes, scales])
    grid = unchanged_blocks(as_read(values, tensor), block)
    if grid.all():  # nothing changed: no quantizing
        return codes, scales
    new_codes, new_scales = rule(tensor)
    per_code = tensor.shape[-1] // codes.shape[-1]  # FP4 pairs: a block's codes are half as many bytes
    return (keep(per_element(grid, (block[0], block[1] // per_code), codes.shape), codes, new_codes),
            keep(grid, scales, new_scales))


@dataclass(frozen=True)
class Fp8Output:
    """How an FP8 output is written: which outputs are quantized (by name), in which blocks and scale format,
    the dtypes the other tensors take (a release's own; absent: the policy's), config.json's quantization_config,
    the scales' dtype (float32, or float8_e8m0fnu or E8M0_BYTES as DeepSeek-V4 and transformers' mxfp8 store them),
    `--quantize_like`'s release, whose bytes unchanged blocks keep (None: every block quantized), and those of the
    quantized outputs that are FP4 experts (DeepSeek-V4's `expert_dtype: fp4`), stored as `fp4_pairs`
    (fp4_experts_quantize.py)."""

    block: tuple[int, int]
    ue8m0: bool
    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    scale_dtype: torch.dtype = SCALE_DTYPE
    release: dict[str, StoredTensor] | None = None
    fp4: frozenset[str] = frozenset()
    fp4_pairs: torch.dtype = FP4_PAIRS

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and len(spec.shape) >= 2

    def _block(self, spec: OutputSpec) -> tuple[int, int]:
        return FP4_BLOCK if spec.name in self.fp4 else self.block

    def _rule(self, spec: OutputSpec) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        if spec.name in self.fp4:
            return partial(fp4_experts_quantize.quantize, self.fp4_pairs, self.scale_dtype)
        return partial(quantize, self.block, self.ue8m0, scale_dtype=self.scale_dtype)

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        # a slab of stacked experts [k, rows, cols] (spec.rows: only experts are written in slabs, and blocks lie in
        # the last two dims) has the same experts' slab of the scales
        codes = (dataclasses.replace(spec, shape=(*spec.shape[:-1], spec.shape[-1] // 2), dtype=self.fp4_pairs)
                 if spec.name in self.fp4 else dataclasses.replace(spec, dtype=FP8))
        return (codes, OutputSpec(spec.name + SCALE_SUFFIX, scale_shape(spec.shape, self._block(spec)),
                                  self.scale_dtype, rows=spec.rows))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        rule = self._rule(spec)
        if self.release is None:
            return list(rule(tensor))
        codes, scales = (self.release[spec.name + part].read(spec.rows) for part in ("", SCALE_SUFFIX))
        codes = codes if spec.name in self.fp4 else codes.to(FP8)
        return list(quantize_keeping(self._block(spec), tensor, (codes, scales.to(self.scale_dtype)), rule))

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        codes, scales = parts
        block = self._block(spec)
        # codes of the half step's size (FP8), or of 1.0 (FP4): times the scales, the bound at each element
        unit, half_step = ((torch.full(codes.shape, ONES, dtype=torch.uint8).view(codes.dtype), E2M1_HALF_STEP)
                           if spec.name in self.fp4 else (torch.full_like(codes, E4M3_HALF_STEP), 1.0))
        return dequantize(block, [codes, scales])[0], dequantize(block, [unit, scales])[0] * half_step
