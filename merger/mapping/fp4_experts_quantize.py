"""DeepSeek-V4's routed experts in FP4: the quantization arithmetic (fp8_quantize.Fp8Output writes them, beside the
release's FP8 weights).

The layout, as transformers' `Fp8Dequantize` reads it (fp8.py reads it the same way): a weight [..., rows, cols] is
stored as FP4 pairs [..., rows, cols / 2] (int8, or torch's float4_e2m1fn_x2: the same bytes) of e2m1 codes, the
even element in the low nibble (e2m1_pack.py), with `<name>_scale_inv` [..., rows, cols / 32]: one power of two per
block of one row by 32 elements, stored as float8_e8m0fnu (or its e8m0 byte, uint8).

The rule is DeepSeek's own, the FP4 quantizer of the inference code DeepSeek ships with V4
(DeepSeek-V4-Flash's `inference/kernel.py`, `fp4_quant_kernel`, which its model runs to fake-quantize the experts'
activations as in training), computed here in float32 on the weight at --dtype, per block of 32:
- amax = the block's largest magnitude, at least 6 x 2^-126 (so an all-zero block has the scale 2^-126, byte 1);
- the scale s = 2^ceil(log2(amax x (1/6))), `1/6` the float32 constant the kernel multiplies by (its
  `fast_round_scale`: the exponent of the float32 product, plus one unless its mantissa bits are all zero);
- each code is the e2m1 value nearest to w / s (exact: a power of two) clamped to ±6, a tie to the even code, the
  sign kept, -0.0 too (CUDA's float to e2m1 conversion, round to nearest even, which the kernel's cast compiles to).
No element saturates (s is the smallest power of two with amax / s <= 6). transformers has no FP4 quantizer;
DeepSeek's kernel needs TileLang and a CUDA GPU, so the tests check this against a retyping of its arithmetic and
transformers' dequantizer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .e2m1_pack import E2M1_MAX, pack_e2m1

GROUP = 32
SMALLEST_AMAX = 6 * 2.0**-126  # the kernel's floor on amax: a scale no smaller than 2^-126, a float32 normal
MAX_INV = torch.tensor(1 / E2M1_MAX, dtype=torch.float32)  # the kernel's `fp4_max_inv`, rounded to float32


def quantize(pairs: torch.dtype, scale_dtype: torch.dtype, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP4 pairs [..., cols / 2] in dtype `pairs`, scales [..., ceil(cols / 32)] as `scale_dtype`: float8_e8m0fnu,
    its e8m0 bytes as uint8, or floats) of `tensor` [..., cols]; a partial last block as if padded with zeros (no amax
    changes)."""
    cols = tensor.shape[-1]
    padded = F.pad(tensor.to(torch.float32), (0, -cols % GROUP))  # exact: every --dtype is float32's subset
    groups = padded.unflatten(-1, (-1, GROUP))
    mantissa, exponent = torch.frexp(groups.abs().amax(-1).clamp(min=SMALLEST_AMAX) * MAX_INV)
    power = exponent - (mantissa == 0.5).to(exponent.dtype)  # a power of two already: its own exponent
    scale = torch.ldexp(torch.ones_like(mantissa), power)
    packed = pack_e2m1((groups / scale.unsqueeze(-1)).flatten(-2), signed_zero=True)[..., :cols // 2]
    if scale_dtype == torch.uint8:  # e8m0 bytes: float8_e8m0fnu's, exact for a power of two in its range
        return packed.view(pairs), scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    return packed.view(pairs), scale.to(scale_dtype)
