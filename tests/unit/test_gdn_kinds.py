"""The Gated DeltaNet hybrids' row kinds alone (merger/mapping/gdn_transforms.py), each through its registered plan
against transformers' own modules for Qwen3-Next and Qwen3.5.

A Megatron tensor is drawn at random and its outputs on a random input are split as megatron-core's forward splits
them (GatedDeltaNet.forward: in_proj rows [q k v z b a]; SelfAttention with attention_output_gate: per query group
[q heads, gate heads, k, v]); the HF module, loaded with the kind's output, must give the same per-head tensors
through its own code (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering, the Linear layers of
Qwen3_5GatedDeltaNet, Qwen3NextAttention's chunk of q_proj into query and gate). The zero-centred norm: HF's own
zero-centred RMSNorm (Qwen3NextRMSNorm, 1 + weight) gated as Megatron gates it equals HF's gated norm loaded with the
kind's output.
"""
from __future__ import annotations

import pytest
import torch

from merger.mapping.kinds import KINDS

pytestmark = pytest.mark.unit

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 24, 2, 6, 4, 3
HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _config(model_type: str):
    import transformers

    cls = transformers.Qwen3NextConfig if model_type == "qwen3_next" else transformers.Qwen3_5TextConfig
    return cls(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
               head_dim=HEAD_DIM, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
               linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, vocab_size=32,
               layer_types=["linear_attention", "full_attention"])


def _planned(kind: str, weight: torch.Tensor, config) -> list[torch.Tensor]:
    shapes, transform = KINDS[kind].plan("w", tuple(weight.shape), config.to_dict())
    out = transform([weight])
    assert [tuple(t.shape) for t in out] == [tuple(s) for s in shapes]
    return out


def _megatron_in_proj(x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    """GatedDeltaNet.forward's split of in_proj's output (TP 1): q, k [.., key heads, dk], v, z [.., value heads,
    dv], b, a [.., value heads]."""
    qk, v = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    q, k, v, z, b, a = (x @ weight.T).split([qk, qk, v, v, VALUE_HEADS, VALUE_HEADS], dim=-1)
    return [q.unflatten(-1, (KEY_HEADS, KEY_DIM)), k.unflatten(-1, (KEY_HEADS, KEY_DIM)),
            v.unflatten(-1, (VALUE_HEADS, VALUE_DIM)), z.unflatten(-1, (VALUE_HEADS, VALUE_DIM)), b, a]


def _in_proj_weight() -> torch.Tensor:
    return torch.randn(2 * KEY_HEADS * KEY_DIM + 2 * VALUE_HEADS * VALUE_DIM + 2 * VALUE_HEADS, HIDDEN)


def test_grouped_in_proj_is_what_qwen3_next_regroups():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config, weight, x = _config("qwen3_next"), _in_proj_weight(), torch.randn(1, 5, HIDDEN)
    module = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    qkvz, ba = _planned("deltanet_in_proj_grouped", weight, config)
    with torch.no_grad():
        module.in_proj_qkvz.weight.copy_(qkvz)
        module.in_proj_ba.weight.copy_(ba)
        hf = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
    for ours, theirs in zip(_megatron_in_proj(x, weight), hf, strict=True):
        torch.testing.assert_close(theirs, ours)


def test_flat_in_proj_is_what_qwen3_5_splits():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config, weight, x = _config("qwen3_5_text"), _in_proj_weight(), torch.randn(1, 5, HIDDEN)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    qkv, z, b, a = _planned("deltanet_in_proj", weight, config)
    with torch.no_grad():
        for linear, value in ((module.in_proj_qkv, qkv), (module.in_proj_z, z), (module.in_proj_b, b),
                              (module.in_proj_a, a)):
            linear.weight.copy_(value)
        # as Qwen3_5GatedDeltaNet.forward splits them (its conv1d runs between, channel by channel)
        q, k, v = module.in_proj_qkv(x).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
        hf = [q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim)),
              v.unflatten(-1, (-1, module.head_v_dim)), module.in_proj_z(x).unflatten(-1, (-1, module.head_v_dim)),
              module.in_proj_b(x), module.in_proj_a(x)]
    for ours, theirs in zip(_megatron_in_proj(x, weight), hf, strict=True):
        torch.testing.assert_close(theirs, ours)


def test_gated_qkv_is_what_qwen3_next_attention_chunks():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    config, x = _config("qwen3_next"), torch.randn(1, 5, HIDDEN)
    per = HEADS // GROUPS
    weight = torch.randn(GROUPS * (2 * per + 2) * HEAD_DIM, HIDDEN)
    module = Qwen3NextAttention(config, layer_idx=1)
    q_proj, k_proj, v_proj = _planned("gated_qkv", weight, config)
    with torch.no_grad():
        module.q_proj.weight.copy_(q_proj)
        module.k_proj.weight.copy_(k_proj)
        module.v_proj.weight.copy_(v_proj)
        # Qwen3NextAttention.forward's own split of q_proj's output into query and gate heads
        query, gate = torch.chunk(module.q_proj(x).view(1, 5, -1, HEAD_DIM * 2), 2, dim=-1)
        hf = [query, gate, module.k_proj(x).unflatten(-1, (-1, HEAD_DIM)),
              module.v_proj(x).unflatten(-1, (-1, HEAD_DIM))]
    # megatron-core's get_query_key_value_tensors with output_gate: [.., groups, (2 per + 2) x head dim]
    q, g, k, v = (x @ weight.T).unflatten(-1, (GROUPS, -1)).split(
        [per * HEAD_DIM, per * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    megatron = [q.reshape(1, 5, HEADS, HEAD_DIM), g.reshape(1, 5, HEADS, HEAD_DIM), k, v]
    for ours, theirs in zip(megatron, hf, strict=True):
        torch.testing.assert_close(theirs, ours)


def test_zero_centred_norm_is_hf_gated_norm_plus_one():
    import torch.nn.functional as F
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    megatron_weight = torch.randn(VALUE_DIM) * 0.1
    zero_centred, gated = Qwen3NextRMSNorm(VALUE_DIM), Qwen3NextRMSNormGated(VALUE_DIM)
    (plain,) = _planned("zero_centred_norm", megatron_weight, _config("qwen3_next"))
    x, gate = torch.randn(7, VALUE_DIM), torch.randn(7, VALUE_DIM)
    with torch.no_grad():
        zero_centred.weight.copy_(megatron_weight)
        gated.weight.copy_(plain)
        torch.testing.assert_close(gated(x, gate), zero_centred(x) * F.silu(gate))
        gated.weight.copy_(megatron_weight)  # Megatron's weight as it is: not the same norm
        assert not torch.allclose(gated(x, gate), zero_centred(x) * F.silu(gate))


def test_in_proj_rows_config_json_does_not_give_are_refused():
    from merger.errors import MergerError

    config = _config("qwen3_next").to_dict()
    with pytest.raises(MergerError, match=r"tensor w has \d+ rows where config.json's Gated DeltaNet \(2 key heads"):
        KINDS["deltanet_in_proj_grouped"].plan("w", (_in_proj_weight().shape[0] + 2, HIDDEN), config)
