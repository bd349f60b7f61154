"""The quantizers a DeepSeek-V4 release's bytes are checked against (#49), none of them merger's code:
- `fp8_quantized`: transformers' own `Fp8Quantize` under the release's config (ue8m0, 128x128) for its FP8 weights;
- `deepseek_fp4`: for its routed experts, DeepSeek's own FP4 quantizer, `fp4_quant_kernel` of the inference code
  DeepSeek ships with V4 (`inference/kernel.py`), retyped here in torch (it needs TileLang and a CUDA GPU):
  transformers has no FP4 quantizer. tests/test_deepseek_v4_write.py checks it against transformers' dequantizer.
"""
from __future__ import annotations

import torch
import transformers

from tests.writers.mxfp8_release import transformers_quantized

GROUP = 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def deepseek_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's `fp4_quant_kernel` (inference/kernel.py, not in place) retyped: per block of 32, amax at least
    6 x 2^-126; the scale 2^ceil(log2(amax x float32(1/6))) as its `fast_round_scale` takes it from the bits of the
    float32 product (exponent, plus one unless the mantissa bits are zero); each w / scale clamped to ±6 and cast to
    e2m1 as CUDA casts (nearest, a tie to the even code, the sign kept); codes two a byte, the even element low.
    (packed codes as uint8, e8m0 scale bytes)."""
    x = w.float().unflatten(-1, (-1, GROUP))
    amax = torch.maximum(x.abs().amax(-1), torch.tensor(6 * 2.0**-126))
    product = (amax * torch.tensor(1 / 6, dtype=torch.float32)).view(torch.int32)
    exponent = ((product >> 23) & 0xFF) - 127 + ((product & 0x7FFFFF) != 0).to(torch.int32)
    y = (x / torch.pow(2.0, exponent.double()).float().unsqueeze(-1)).clamp(-6, 6)
    distance = (y.abs().unsqueeze(-1) - E2M1).abs()
    nearest = distance == distance.amin(-1, keepdim=True)  # one magnitude, or two at a tie
    even = nearest & (torch.arange(8) % 2 == 0)
    magnitude = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    codes = (magnitude | torch.signbit(y).long() << 3).flatten(-2)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8), (exponent + 127).to(torch.uint8)


def fp8_quantized(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize under the release's config: (float8 codes, e8m0 scale bytes)."""
    config = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0")
    return transformers_quantized(name, weight, config)
