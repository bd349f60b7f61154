"""Which NVFP4 weights share a global scale when one step writes several (merger/mapping/nvfp4_release_layout.py):
the sets the release shares one among, and no others. What each set is quantized to is compressed-tensors' and
ModelOpt's bytes (tests/test_compressed_tensors_nvfp4_write.py, tests/test_modelopt_nvfp4_write.py); here the
oracle is the layout quantizing each weight on its own, which those tests check against the tools."""
from __future__ import annotations

import pytest
import torch

from merger.mapping.nvfp4_release_layout import MODELOPT, Nvfp4Output
from merger.mapping.steps import OutputSpec

pytestmark = pytest.mark.unit

GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("producer", ["compressed-tensors", "ModelOpt"])
def test_weights_one_step_writes_share_a_global_scale_only_where_the_release_shares_one(producer):
    """A step writing gate and up (a Megatron fc1), of a release that shares no scale between them (llmcompressor's
    model_free_ptq): each is quantized as on its own. Named as a set, they share the scale of the larger."""
    generator = torch.Generator().manual_seed(0)
    weights = {GATE: (torch.randn(64, 96, generator=generator) * 0.02).bfloat16(),
               UP: (torch.randn(64, 96, generator=generator) * 0.08).bfloat16()}
    extra = () if producer == "compressed-tensors" else (MODELOPT,)
    alone = Nvfp4Output(frozenset(weights), {}, {}, *extra)
    apart = alone.quantize_together(weights)
    for name, w in weights.items():
        own = alone.quantize(w, OutputSpec(name, (64, 96), torch.bfloat16))
        assert all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                   for a, b in zip(apart[name], own)), name
    shared = Nvfp4Output(frozenset(weights), {}, {}, *extra, shared=[frozenset(weights)]).quantize_together(weights)
    assert torch.equal(shared[GATE][2], shared[UP][2]) and torch.equal(shared[UP][2], apart[UP][2])
    assert not torch.equal(shared[GATE][2], apart[GATE][2])
