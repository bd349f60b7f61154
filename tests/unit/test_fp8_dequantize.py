"""The FP8 block dequantization alone, on stacked weights (MoE experts saved as one [E, rows, cols] tensor with
scales [E, ceil(rows / b0), ceil(cols / b1)]): each expert equals its own 2-D dequantization, computed here by
looping over every element's block (the oracle), partial edge blocks included."""
from __future__ import annotations

import pytest
import torch

from merger.mapping.fp8 import dequantize

pytestmark = pytest.mark.unit


def test_stacked_weights_dequantize_per_expert_and_block():
    torch.manual_seed(0)
    block, (experts, rows, cols) = (8, 16), (3, 20, 36)
    weight = torch.randn(experts, rows, cols).to(torch.float8_e4m3fn)
    scale = torch.rand(experts, -(-rows // block[0]), -(-cols // block[1])) + 0.5
    want = torch.empty(experts, rows, cols)
    for e in range(experts):
        for i in range(rows):
            for j in range(cols):
                want[e, i, j] = weight[e, i, j].float() * scale[e, i // block[0], j // block[1]]
    (got,) = dequantize(block, [weight, scale])
    assert got.dtype == torch.float32 and torch.equal(got, want)
