"""`--verify` of a quantized output: each quantized tensor, read back by merger's reader (the arithmetic that
dequantizes a release: fp8.py, compressed_tensors_codec.py), lies within its format's error bound of the weight it
was quantized from.

--verify's byte comparison proves that the files hold what the quantizer computed; this proves that what it
computed reads back as the weights. A quantizer that gave a block another block's scale, or codes the reader takes
another way, fails here, before anything is moved to the target, and not in the first user's evaluation.

The bound of an element is half the largest step between the format's codes, times its block's or group's scale:
rounding to the nearest code is off by at most that, and no scheme merger writes saturates (each scale makes its
block's largest magnitude a code or less) but NVFP4, whose float8 group scale may round below amax / 6: its bound
adds what that leaves beyond 6 codes (nvfp4_release_layout.py). FP8 e4m3: codes up to 448, the largest step 32, so 16 x scale; INT4:
steps of 1, so 0.5 x scale, plus what the scale's own rounding to its dtype adds; e2m1 (MXFP4): the step from 4
to 6, so 1 x scale. A block `--quantize_like` kept from the release reads back as the release's values, which the
weight equals as cast to its dtype (release_blocks.py): well within the bound.
"""
from __future__ import annotations

import torch

from ..errors import MergerError
from .steps import DEQUANTIZED

SLACK = 1 + 2**-10  # the float32 arithmetic of the difference, at an element that rounded exactly halfway
# Half the largest step between codes, in units of the scale (above)
E4M3_HALF_STEP = 16.0
E2M1_HALF_STEP = 1.0
INT4_HALF_STEP = 0.5


def int4_half_step(scale_dtype: torch.dtype) -> float:
    """INT4's, where the group's scale amax / 7.5 was rounded to `scale_dtype` (by up to half its eps): the group's
    largest magnitude may then sit that much beyond 7.5 and still be written as 7 (or -8)."""
    return INT4_HALF_STEP + 4 * torch.finfo(scale_dtype).eps


def check(name: str, format_name: str, weight: torch.Tensor, values: torch.Tensor, bound: torch.Tensor) -> None:
    """Raise unless every element of `values` (the quantized tensor as merger reads it) is within `bound` of
    `weight`, the tensor it was quantized from."""
    diff = (weight.to(DEQUANTIZED) - values).abs()
    over = (diff > bound * SLACK).reshape(-1)
    if not bool(over.any()):
        return
    beyond = torch.where(over, diff.reshape(-1) - bound.reshape(-1), -torch.inf)
    at = int(beyond.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), weight.shape))
    raise MergerError(f"--verify: {name}, quantized as {format_name}, reads back {float(diff.reshape(-1)[at]):.4g} "
                      f"away from its {str(weight.dtype).removeprefix('torch.')} weight at {list(where)}, beyond the "
                      f"format's bound there ({float(bound.reshape(-1)[at]):.4g}; {int(over.sum())} elements beyond "
                      f"it): the output would not load as the merged weights, and nothing was moved to the target")
