"""The arithmetic of the compressed-tensors formats merger reads: stored codes and scales back to weights.

As compressed-tensors 0.20 decompresses them (compressors/nvfp4, pack_quantized, mxfp4, mxfp8, mx_utils;
quantization/lifecycle/forward.py `dequantize` of groups along the last dim), in float32, so that each weight is
rounded at most once, to --dtype, by the writer:
- FP4 (NVFP4, MXFP4): `weight_packed` uint8 holds two e2m1 codes a byte, the even element in the low nibble; bit
  3 of a code is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 is -0, kept so).
- INT4 `pack-quantized`: `weight_packed` int32 holds eight codes a word, element i in bits 4i..4i+3, each the
  signed value plus 8 (symmetric: no zero point). Read with shifts of the word, so the host's byte order is moot.
- A group's elements are multiplied by its scale: NVFP4's `weight_scale` (float8) divided by the tensor's
  `weight_global_scale` in float32, before the product, as compressed-tensors does; INT4's `weight_scale` as stored;
  MX's `weight_scale`, an e8m0 exponent byte: 2^(byte - 127).
compressed-tensors itself computes FP4 and MX products in bfloat16 (exact: a code times a power of two) and INT4's
and NVFP4's in the scale's dtype or float32 and then rounds to bfloat16; merger's float32 values cast to bfloat16
are its values bit for bit.
ModelOpt's NVFP4 (modelopt.py) reads the same e2m1 codes but for code 8, which its table has as +0.0, and
multiplies each value by the product of the group's float8 scale and the tensor's `weight_scale_2`, in float32 as
ModelOpt 0.47's `NVFP4QTensor.dequantize`; its MXFP8 is compressed-tensors' arithmetic (float8 value times
2^(byte - 127) in float32, `MXFP8QTensor.dequantize`).
"""
from __future__ import annotations

import torch

from .steps import DEQUANTIZED

E8M0_BIAS = 127  # an e8m0 scale byte is 2^(byte - 127)

# e2m1 code -> value: the magnitudes, then the same negated (sign bit 3), -0.0 for code 8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
INT4_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # element i of a word sits at bit 4i
INT4_OFFSET = 8


# ModelOpt's reading of the same codes: code 8 is +0.0 (its table has no -0.0)
E2M1_UNSIGNED_ZERO = torch.where(E2M1 == 0, 0.0, E2M1)


def fp4_values(packed: torch.Tensor, table: torch.Tensor = E2M1) -> torch.Tensor:
    """uint8 [..., n / 2] of e2m1 code pairs -> float32 [..., n], each code's value in `table`."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return table[codes.long()]


def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n / 8] of eight offset nibbles a word -> float32 [..., n]."""
    nibbles = (packed.unsqueeze(-1) >> INT4_SHIFTS) & 0xF  # the mask drops the sign an arithmetic shift brings
    return (nibbles.flatten(-2) - INT4_OFFSET).to(DEQUANTIZED)


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 exponent bytes -> 2^(byte - 127) in float32 (exact: 2^-127 is a float32 subnormal; 255 is inf)."""
    return torch.pow(2.0, scale.to(torch.float64) - E8M0_BIAS).to(DEQUANTIZED)


def grouped(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [..., n] times their group's scale [..., n / group], the groups consecutive along the last dim."""
    groups = values.unflatten(-1, (scale.shape[-1], -1))
    return (groups * scale.unsqueeze(-1)).flatten(-2)


def nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return grouped(fp4_values(packed), scale.to(DEQUANTIZED) / global_scale.to(DEQUANTIZED).reshape(1))


def modelopt_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4: the group's float8 `weight_scale` times the tensor's `weight_scale_2` first, then each
    value times that product, in float32, as ModelOpt's NVFP4QTensor.dequantize does."""
    return grouped(fp4_values(packed, E2M1_UNSIGNED_ZERO), scale.to(DEQUANTIZED) * scale_2.to(DEQUANTIZED))


def mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return grouped(fp4_values(packed), e8m0(scale))


def int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return grouped(int4_values(packed), scale.to(DEQUANTIZED))


def mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return grouped(weight.to(DEQUANTIZED), e8m0(scale))
