"""Rounding to e2m1 codes and packing them two a byte: the encoding the FP4 formats merger writes share
(compressed-tensors' MXFP4 and NVFP4, ModelOpt's NVFP4, DeepSeek-V4's FP4 experts; compressed_tensors_codec.py reads
them back).

A code's bit 3 is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a byte holds the even element
in its low nibble. A value (a weight over its group's scale) is clamped to ±6 and rounded to the nearest magnitude, a
tie to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4): compressed-tensors'
`cast_to_fp4` and IEEE round-to-nearest-even (CUDA's conversion to e2m1) agree on every value.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
# where a magnitude reaches the next e2m1 code, and whether a tie there goes up (to an even code)
STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
SIGN = 0x8


def pack_e2m1(scaled: torch.Tensor, signed_zero: bool = False) -> torch.Tensor:
    """uint8 [..., n / 2] of the e2m1 codes of float32 `scaled` [..., n] (each weight over its group's scale) by
    compressed-tensors' `cast_to_fp4` and `pack_fp4_to_uint8`: clamped to ±6, rounded as the module docstring says,
    the sign bit set for a negative value; with `signed_zero`, for -0.0 too, as a float conversion (CUDA's, which
    DeepSeek's FP4 kernel uses: fp4_experts_quantize.py) keeps the sign of a zero."""
    magnitude = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX).abs()
    codes = sum((magnitude >= at if up else magnitude > at).to(torch.uint8) for at, up in STEPS)
    codes = codes | (torch.signbit(scaled) if signed_zero else scaled < 0).to(torch.uint8) * SIGN
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
