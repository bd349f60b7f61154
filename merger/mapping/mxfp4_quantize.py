"""Writing gpt-oss's MoE experts in MXFP4, as the gpt-oss release stores them: the format and the arithmetic.

The format, as transformers 5.24 reads it (integrations/mxfp4.py; quantizers/quantizer_mxfp4.py):
- Only the experts are quantized: each decoder layer's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`.
  In a bf16 checkpoint (and in the model) they are [E, in, out] (gate_up_proj [E, hidden, 2 * intermediate], its
  gate and up columns interleaved; down_proj [E, intermediate, hidden]), multiplied as `x @ W[e]`. Their biases,
  attention, router, embeddings and norms stay unquantized (bf16 in the release).
- The release stores `<name>_blocks`, uint8 [E, out, in / 32, 16], and `<name>_scales`, uint8 [E, out, in / 32]:
  the weight transposed to [E, out, in], its `in` dim (the one the product sums over) cut into blocks of 32
  consecutive elements, each block 16 bytes of two 4-bit e2m1 codes and one scale byte.
- A byte holds element 2j in its low nibble and element 2j + 1 in its high nibble. A nibble's bit 3 is the sign,
  bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (so 0x8 is -0).
- A scale byte is an e8m0 exponent with bias 127: the block's elements are the nibbles' values times
  2^(byte - 127).
- transformers' CPU dequantizer (`convert_moe_packed_tensors`, which `from_pretrained` runs on CPU, where it has
  no MXFP4 kernels) looks each nibble up in that table, multiplies by the power of two (ldexp), lays the blocks of
  a row end to end and transposes back to [E, in, out]. It has no partial blocks: `in` must be a multiple of 32.
- config.json says `"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`
  (transformers' Mxfp4Config); the gpt-oss releases list attention, router, embeddings and lm_head there.

The arithmetic: transformers quantizes with `downcast_to_mxfp_torch`, the torch reference that ships in the gpt-oss
Triton kernels package it fetches from the Hub at run time (`kernels`), in its default "round up" scale mode. This
is the same rule (checked once against a retyped copy of that function: the same bytes on random, all-zero, -0, tie
and on-grid blocks), computed here in float32 one expert at a time: per block, the scale is the smallest power of
two X with max|w| / X <= 6, taken from max|w| / 6 in float32 (X = 2^-126 at the least, and the scale byte 0 for an
all-zero block), so no element saturates; each element w / X is rounded to the nearest e2m1 magnitude, a tie away
from zero, and keeps its sign (a negative that rounds to zero is -0). This differs from the OCP MX spec's example
rule (X = 2^(floor(log2 max|w|) - 2), which clamps the block's largest elements to 6 when max|w| / X lies in (6,
8)): rounding up keeps every element within half an e2m1 step of itself at its block's scale.

`--quantize_like` keeps the release's bytes (its 16 code bytes and scale byte) for each block whose values are the
release's own (release_blocks.py): a release's scale need not be the smallest that holds its block (a block with no
4 or 6 in it), nor its zeros +0, and quantizing its values again would change those bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compressed_tensors_codec import E8M0_BIAS, mxfp4
from .quantized_check import E2M1_HALF_STEP
from .release_blocks import StoredTensor, as_read, keep
from .steps import OutputSpec

BLOCK = 32  # elements per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
PACKED = torch.uint8
E2M1_MAX = 6.0
# the midpoints between consecutive e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}: a magnitude's code is how many
# of them it reaches (a tie goes up, away from zero)
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
SIGN = 0x8
ONES = 0x22  # a byte of two e2m1 codes of 1.0: times the scales, the block's scale at each element


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of `_blocks` and `_scales` of an expert weight [E, in, out]."""
    experts, rows, cols = shape
    return (experts, cols, rows // BLOCK, BLOCK // 2), (experts, cols, rows // BLOCK)


def _scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The e8m0 byte of the smallest power of two X with amax / X <= 6 (amax / 6 rounded up to a power of two)."""
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)  # amax / 6 = mantissa * 2^exponent, mantissa in [0.5, 1)
    power = exponent - (mantissa == 0.5).to(exponent.dtype)  # already a power of two: itself
    return torch.where(amax > 0, (power + E8M0_BIAS).clamp(min=1, max=254), 0).to(PACKED)


def quantize_expert(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [out, in / 32, 16], scales [out, in / 32]) of one expert's weight [in, out]."""
    rows, cols = weight.shape
    w = weight.t().contiguous().to(torch.float32).reshape(cols, rows // BLOCK, BLOCK)
    scales = _scale_bytes(w.abs().amax(dim=-1))
    q = w * torch.pow(2.0, E8M0_BIAS - scales.to(torch.float64)).to(torch.float32).unsqueeze(-1)  # exact: powers of 2
    codes = torch.bucketize(q.abs(), MIDPOINTS, right=True).to(PACKED) | (torch.signbit(q).to(PACKED) * SIGN)
    pairs = codes.reshape(cols, rows // BLOCK, BLOCK // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scales


def quantize(weight: torch.Tensor) -> list[torch.Tensor]:
    """[blocks, scales] of an expert weight [E, in, out], one expert at a time (beside the result, one expert's
    float32 copy is held)."""
    blocks_shape, scales_shape = packed_shapes(tuple(weight.shape))
    blocks, scales = torch.empty(blocks_shape, dtype=PACKED), torch.empty(scales_shape, dtype=PACKED)
    for e in range(weight.shape[0]):
        blocks[e], scales[e] = quantize_expert(weight[e])
    return [blocks, scales]


def _values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight [E, in, out] that `blocks` and `scales` hold, as transformers' dequantizer reads them."""
    return mxfp4(blocks.flatten(-2), scales).transpose(-1, -2)


def quantize_keeping(weight: torch.Tensor, release: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """quantize(), but each block whose values are the `release`'s (its blocks and scales, dequantized and cast to
    `weight`'s dtype: what transformers' dequantizer gives) keeps the release's bytes."""
    blocks, scales = release
    values = _values(blocks, scales)
    grid = as_read(values, weight).transpose(-1, -2).unflatten(-1, (-1, BLOCK)).all(-1)
    if grid.all():  # nothing changed: no quantizing
        return [blocks, scales]
    new_blocks, new_scales = quantize(weight)
    return [keep(grid.unsqueeze(-1), blocks, new_blocks), keep(grid, scales, new_scales)]


@dataclass(frozen=True)
class Mxfp4Output:
    """How an MXFP4 output is written: which outputs are quantized (by name), the dtypes the other tensors take
    (a release's own; absent: the policy's), config.json's quantization_config, and `--quantize_like`'s release,
    whose bytes unchanged blocks keep (None: every block quantized)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    release: dict[str, StoredTensor] | None = None

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and len(spec.shape) == 3

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        blocks, scales = packed_shapes(spec.shape)
        # an expert's slab of the weight (spec.rows) is the same experts' slab of its blocks and scales
        return (OutputSpec(spec.name + BLOCKS_SUFFIX, blocks, PACKED, rows=spec.rows),
                OutputSpec(spec.name + SCALES_SUFFIX, scales, PACKED, rows=spec.rows))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        if self.release is None:
            return quantize(tensor)
        return quantize_keeping(tensor, (self.release[spec.name + BLOCKS_SUFFIX].read(spec.rows),
                                         self.release[spec.name + SCALES_SUFFIX].read(spec.rows)))

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        return _values(*parts), _values(torch.full_like(parts[0], ONES), parts[1]) * E2M1_HALF_STEP
