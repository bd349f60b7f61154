"""Family records and row kinds alone: tables refused at import for an unknown kind, a rename with several
targets or a reasonless skip; each kind's plan against a hand-built reference of the layout it undoes; every
family in the registry written by a test that checks it against the framework's own forward pass; and the command
line's --model values for torchtitan, one per torchtitan family.

Oracles: the layouts as Megatron and torchtitan build them, assembled here with plain indexing (Megatron's fused
QKV: per query group its query heads then one key and one value head; its padded vocab; torchtitan's interleaved
rotary pairs; gpt-oss's [E, out, in] experts), and the test files' own case lists.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from merger.errors import MergerError
from merger.flags import TORCHTITAN_MODELS
from merger.mapping.families import FAMILIES, MEGATRON_FAMILIES, TORCHTITAN_FAMILIES, checked_together
from merger.mapping.family import Family, MtpLayout, Row
from merger.mapping.kinds import KINDS, register, step
from merger.mapping.torchtitan import MODELS

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent.parent


def test_a_row_of_an_unknown_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"row 'mlp.linear_fc1.weight': unknown kind 'gate_upp'"):
        Row("mlp.linear_fc1.weight", "gate_upp", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def test_a_rename_with_several_targets_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"row 'mlp.linear_fc1.weight': a rename row has 1 HF name"):
        Row("mlp.linear_fc1.weight", "rename", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def test_a_skip_without_a_reason_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"row 'moe.expert_bias_E': a skip row needs the reason"):
        Row("moe.expert_bias_E", "skip")


def test_a_row_with_the_wrong_number_of_targets_for_its_kind_is_refused():
    with pytest.raises(ValueError, match=r"row 'self_attention.linear_qkv.weight': a qkv row has 3 HF name"):
        Row("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight"))


def test_an_expert_row_must_number_its_targets():
    with pytest.raises(ValueError, match=r"row 'moe.w1_EFD': its HF names .* lack the expert number"):
        Row("moe.w1_EFD", "experts", ("mlp.gate_proj.weight",))


def test_a_family_is_refused_for_a_mark_or_row_count_it_has_no_row_for():
    rows = (Row("attention.wq.weight", "rename", ("self_attn.q_proj.weight",)),)
    with pytest.raises(ValueError, match=r"family toy: mark 'attention.wkv_a.weight' is none of its torchtitan rows"):
        Family("toy", ("toy",), torchtitan=rows, torchtitan_marks=("attention.wkv_a.weight",))
    with pytest.raises(ValueError, match=r"family toy: config row count for 'self_attn.q_a_proj.weight'"):
        Family("toy", ("toy",), megatron=rows, config_rows={"self_attn.q_a_proj.weight": lambda c: 1})
    with pytest.raises(ValueError, match=r"row 'attention.wq.weight' appears twice in the toy family's Megatron rows"):
        Family("toy", ("toy",), megatron=rows + rows)
    with pytest.raises(ValueError, match=r"family toy: layer type 'linear_attention' is told by "
                                         r"'self_attention.in_proj.weight', which is none of its Megatron rows"):
        Family("toy", ("toy",), megatron=rows, layer_types={"linear_attention": "self_attention.in_proj.weight"})



def test_an_mtp_layout_naming_its_own_tensors_names_them_all_beside_its_layer():
    """A layout that writes an MTP layer's own tensors under names of their own (Qwen3-Next's mtp.fc) names where
    its layer goes, and every own tensor each naming gives: one left out would land under the layer unnoticed."""
    with pytest.raises(ValueError, match=r"MTP layout k: its own tensors' names need the layer's name too"):
        MtpLayout("k", own={"eh_proj.weight": "mtp.fc.weight"})
    toy = Family("toy", ("toy",), mtp=MtpLayout("k", layer="mtp.layers.{j}.", own={"eh_proj.weight": "mtp.fc.weight"}))
    with pytest.raises(ValueError, match=r"family toy: its MTP layout names \['eh_proj.weight'\], Megatron's MTP "
                                         r"rows give \['eh_proj.weight', 'enorm.weight'"):
        checked_together((toy,))

def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match="kind 'rename' is registered twice"):
        register(KINDS["rename"])


def _plan(kind: str, shape: tuple[int, ...], config: dict):
    return KINDS[kind].plan("t", shape, config)


def test_qkv_splits_megatrons_grouped_layout():
    heads, groups, head_dim, hidden = 6, 2, 4, 8
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(groups * head_dim, hidden), torch.randn(groups * head_dim, hidden)
    per = heads // groups
    fused = torch.cat([torch.cat([q[g * per * head_dim:(g + 1) * per * head_dim], k[g * head_dim:(g + 1) * head_dim],
                                  v[g * head_dim:(g + 1) * head_dim]]) for g in range(groups)])
    config = dict(num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim, hidden_size=hidden)
    shapes, fn = _plan("qkv", tuple(fused.shape), config)
    assert shapes == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert all(torch.equal(a, b) for a, b in zip(fn([fused]), [q, k, v]))
    with pytest.raises(MergerError, match="tensor t has 33 rows"):
        _plan("qkv", (33, hidden), config)


def test_vision_qkv_puts_each_heads_q_k_v_into_hfs_q_k_v_order():
    """A ViT's linear_qkv in megatron-core has a query group per head: per head [q; k; v]. HF's fused qkv (Qwen3-VL's
    tower: its forward reshapes the output as (3, heads, head_dim)) is [every q; every k; every v]."""
    heads, head_dim, hidden = 3, 4, 12
    q, k, v = (torch.randn(heads * head_dim, hidden) for _ in range(3))
    per_head = torch.cat([part[h * head_dim:(h + 1) * head_dim] for h in range(heads) for part in (q, k, v)])
    config = {"vision_config": {"num_heads": heads, "hidden_size": hidden}}
    shapes, fn = _plan("vision_qkv", tuple(per_head.shape), config)
    assert shapes == [tuple(per_head.shape)]
    assert torch.equal(fn([per_head])[0], torch.cat([q, k, v]))
    assert torch.equal(fn([per_head[:, 0]])[0], torch.cat([q, k, v])[:, 0])  # its bias
    with pytest.raises(MergerError, match="tensor t has 30 rows; 3 heads in 3 query groups of head dim 4 need 36"):
        _plan("vision_qkv", (30, hidden), config)
    with pytest.raises(MergerError, match="config.json's vision_config has no 'num_heads'"):
        _plan("vision_qkv", tuple(per_head.shape), {})


def test_layer_qkv_splits_with_its_layers_own_kv_heads_and_narrower_values():
    """MiMo-V2-Flash: a sliding-window layer has twice num_key_value_heads (transformers' MiMoV2FlashAttention), and
    every layer's values are v_head_dim wide; the layer is read off the tensor's name."""
    heads, head_dim, v_head_dim, hidden = 4, 4, 2, 8
    config = dict(num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, v_head_dim=v_head_dim,
                  hidden_size=hidden, layer_types=["full_attention", "sliding_attention"])
    for layer, groups in ((0, 1), (1, 2)):
        q = torch.randn(heads * head_dim, hidden)
        k, v = torch.randn(groups * head_dim, hidden), torch.randn(groups * v_head_dim, hidden)
        per = heads // groups
        fused = torch.cat([torch.cat([q[g * per * head_dim:(g + 1) * per * head_dim],
                                      k[g * head_dim:(g + 1) * head_dim], v[g * v_head_dim:(g + 1) * v_head_dim]])
                           for g in range(groups)])
        name = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
        shapes, fn = KINDS["layer_qkv"].plan(name, tuple(fused.shape), config)
        assert shapes == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
        assert all(torch.equal(a, b) for a, b in zip(fn([fused]), [q, k, v]))
    with pytest.raises(MergerError, match="layer_types does not give the type of the layer of tensor "
                                          "decoder.layers.2.self_attention.linear_qkv.weight"):
        KINDS["layer_qkv"].plan("decoder.layers.2.self_attention.linear_qkv.weight", (24, hidden), config)


def test_gate_up_splits_the_halves_and_refuses_odd_rows():
    gate, up = torch.randn(5, 3), torch.randn(5, 3)
    shapes, fn = _plan("gate_up", (10, 3), {})
    assert shapes == [(5, 3), (5, 3)]
    assert all(torch.equal(a, b) for a, b in zip(fn([torch.cat([gate, up])]), [gate, up]))
    with pytest.raises(MergerError, match="odd number of rows"):
        _plan("gate_up", (9, 3), {})


def test_vocab_drops_padding_rows_and_is_a_cast_without_them():
    embedding = torch.randn(101, 4)
    padded = torch.cat([embedding, torch.zeros(27, 4)])  # Megatron pads to a multiple of 128 x TP
    shapes, fn = _plan("vocab", (128, 4), {"vocab_size": 101})
    assert shapes == [(101, 4)] and torch.equal(fn([padded])[0], embedding)
    written = step("embedding", (101, 4), torch.float32, "vocab", ("model.embed_tokens.weight",), {"vocab_size": 101})
    assert written.is_cast and written.outputs[0].shape == (101, 4)
    with pytest.raises(MergerError, match="fewer than config.json's vocab_size 101"):
        _plan("vocab", (100, 4), {"vocab_size": 101})


@pytest.mark.parametrize("kind", ["rotary_q", "rotary_kv"])
def test_rotary_moves_interleaved_pairs_to_halves_per_head(kind):
    heads, kv_heads, head_dim, hidden = 4, 2, 6, 5
    count = heads if kind == "rotary_q" else kv_heads
    interleaved = torch.randn(count * head_dim, hidden)
    halves = torch.empty_like(interleaved)
    for h in range(count):
        for i in range(head_dim // 2):  # pair (2i, 2i+1) of head h -> rows i and i + head_dim/2
            halves[h * head_dim + i] = interleaved[h * head_dim + 2 * i]
            halves[h * head_dim + head_dim // 2 + i] = interleaved[h * head_dim + 2 * i + 1]
    config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden)
    shapes, fn = _plan(kind, tuple(interleaved.shape), config)
    assert shapes == [tuple(interleaved.shape)] and torch.equal(fn([interleaved])[0], halves)


def test_fused_experts_are_written_in_to_out_and_stacked_experts_one_at_a_time():
    experts = torch.randn(3, 4, 5)  # [E, out, in]
    shapes, fn = _plan("experts_fused", (3, 4, 5), {})
    swapped = torch.stack([e.T for e in experts])
    assert shapes == [(3, 5, 4)] and torch.equal(fn([experts])[0], swapped)
    assert _plan("experts", (3, 4, 5), {}) == ([(4, 5)], None) and KINDS["experts"].per_expert


@pytest.mark.parametrize("kind", ["experts_gate_up_interleaved", "gate_up_interleaved"])
def test_stacked_megatron_fc1_is_interleaved_as_gpt_oss_keeps_gate_up(kind):
    """gpt-oss's forward takes gate = gate_up[..., ::2] and up = gate_up[..., 1::2] of x @ gate_up_proj[e] (+ the
    bias); Megatron's fc1 (and its bias) is [gate; up] per expert, stacked here [E, 2F, ...]."""
    experts, inter, hidden = 3, 4, 5
    gate, up = torch.randn(experts, inter, hidden), torch.randn(experts, inter, hidden)
    weight = kind == "experts_gate_up_interleaved"
    fc1 = torch.cat([gate, up], dim=1) if weight else torch.cat([gate[..., 0], up[..., 0]], dim=1)
    shapes, fn = _plan(kind, tuple(fc1.shape), {})
    (out,) = fn([fc1])
    assert shapes == [tuple(out.shape)] == [(experts, hidden, 2 * inter) if weight else (experts, 2 * inter)]
    halves = (out[..., ::2], out[..., 1::2])
    want = (gate.transpose(1, 2), up.transpose(1, 2)) if weight else (gate[..., 0], up[..., 0])
    assert all(torch.equal(h, w) for h, w in zip(halves, want))
    with pytest.raises(MergerError, match="is not \\[gate; up\\]"):
        _plan(kind, (3, 7, 5), {})


@pytest.mark.parametrize("kind", ["experts_gate_up_interleaved", "gate_up_interleaved", "experts_fused", "rename"])
def test_experts_stacked_one_at_a_time_equal_the_kind_on_the_whole_stack(kind):
    from merger.mapping.transforms import stack_slab

    experts = [torch.randn(6, 5) for _ in range(3)]
    stack = torch.stack(experts)
    shapes, fn = _plan(kind, tuple(stack.shape), {})
    want = stack if fn is None else fn([stack])[0]
    slabs = [stack_slab([t], each=fn)[0] for t in experts]  # each expert's slab, as its own step writes it
    assert all(s.shape == (1, *shapes[0][1:]) for s in slabs) and torch.equal(torch.cat(slabs), want)


def test_a_stacked_row_is_a_row_of_one_expert():
    with pytest.raises(ValueError, match="only a row of one expert"):
        Row("mlp.router.weight", "rename", ("mlp.router.weight",), stacked=True)
    with pytest.raises(ValueError, match="hold the expert number"):
        Row("mlp.experts.local_experts.{e}.linear_fc2.bias", "rename", ("mlp.experts.{e}.down_proj_bias",),
            stacked=True)


def test_an_adapter_on_a_stacked_expert_is_refused_not_folded_into_one_expert():
    """A LoRA's base linear is written on its own (megatron_shards.py): a gpt-oss expert is only ever part of the
    stack, so an adapter on it is one error naming the tensor."""
    from types import SimpleNamespace

    from merger.mapping.families import megatron_family
    from merger.mapping.megatron import family_table, hf_names

    family = megatron_family("gpt_oss")
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    with pytest.raises(MergerError, match=r"local_experts\.1\.linear_fc1\.weight is written stacked with the other "
                                          r"experts' as model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        hf_names(family_table(family), name, 2, family, SimpleNamespace(root="/ckpt"))
    assert hf_names(family_table(family), "decoder.layers.0.self_attention.linear_proj.weight", 2, family,
                    SimpleNamespace(root="/ckpt")) == ("rename", ("model.layers.0.self_attn.o_proj.weight",))


def test_tp_splits_sinks_and_full_width_qk_norms_megatron_does_not_flag():
    """One TP rank's file: 2 query heads and 1 key-value head of 16 (qkv rows (2 + 1 + 1) x 16). MiniMax-M2's norms
    hold the rank's heads (32 and 16), split with them; one head's norms (16 each) are whole on every rank."""
    from merger.sources.megatron_tp import tp_dim

    attention = "decoder.layers.0.self_attention."
    qkv = {attention + "linear_qkv.weight": (64, 64)}
    full = {**qkv, attention + "q_layernorm.weight": (32,), attention + "k_layernorm.weight": (16,)}
    per_head = {**qkv, attention + "q_layernorm.weight": (16,), attention + "k_layernorm.weight": (16,)}
    for norm in ("q_layernorm.weight", "k_layernorm.weight"):
        assert tp_dim(attention + norm, full[attention + norm], full) == 0
        assert tp_dim(attention + norm, (16,), per_head) is None
    assert tp_dim(attention + "core_attention.softmax_offset", (2,), qkv) == 0
    assert tp_dim(attention + "linear_proj.bias", (64,), qkv) is None


def test_cat_joins_torchtitans_separate_gated_deltanet_parts_as_hf_fuses_them():
    """HF's in_proj_qkv is [q; k; v] (its forward splits the projection at key_dim, key_dim, value_dim), conv1d's
    channels too: the join writes a row's source then its joined tensors, in the row's order."""
    q, k, v = torch.randn(4, 6), torch.randn(4, 6), torch.randn(8, 6)
    written = step("layers.0.attn.in_proj_q.weight", (4, 6), torch.float32, "cat",
                   ("model.layers.0.linear_attn.in_proj_qkv.weight",), {},
                   joined=(("layers.0.attn.in_proj_k.weight", (4, 6)), ("layers.0.attn.in_proj_v.weight", (8, 6))))
    assert written.inputs == ("layers.0.attn.in_proj_q.weight", "layers.0.attn.in_proj_k.weight",
                              "layers.0.attn.in_proj_v.weight")
    assert written.outputs[0].shape == (16, 6)
    fused = written.run([q, k, v])[0]
    assert torch.equal(fused[:4], q) and torch.equal(fused[4:8], k) and torch.equal(fused[8:], v)
    with pytest.raises(MergerError, match="they differ past dim 0"):
        step("q", (4, 6), torch.float32, "cat", ("qkv",), {}, joined=(("k", (4, 5)),))


def test_patch_conv3d_is_the_linear_over_flattened_patches():
    """torch's own Conv3d with stride = kernel, on patches, gives what the Linear gives on them flattened."""
    dim, channels, frames, side = 5, 3, 2, 2
    linear = torch.randn(dim, channels * frames * side * side)
    config = {"vision_config": {"in_channels": channels, "temporal_patch_size": frames, "patch_size": side}}
    shapes, fn = _plan("patch_conv3d", tuple(linear.shape), config)
    assert shapes == [(dim, channels, frames, side, side)]
    patches = torch.randn(7, channels, frames, side, side)
    conv = torch.nn.functional.conv3d(patches, fn([linear])[0], stride=(frames, side, side))
    assert torch.allclose(conv.flatten(1), patches.flatten(1) @ linear.T, atol=1e-5)
    with pytest.raises(MergerError, match="vision_config gives patches of 3 channels x 2 frames x 16 x 16"):
        _plan("patch_conv3d", (dim, 24), {})  # transformers' defaults where config.json says nothing


def test_patch_conv2d_is_the_linear_over_flattened_patches():
    """transformers' Kimi-K2.5 patch embedding (its Conv2d, stride = kernel), loaded with the kind's output, gives on
    patches what torchtitan's Linear gives on them flattened (C x P x P, its to_hf's order)."""
    from transformers import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionPatchEmbed

    dim, side = 6, 2  # an even width: its temporal sinusoid needs one
    linear = torch.randn(dim, 3 * side * side)
    config = {"vision_config": {"patch_size": side}}
    shapes, fn = _plan("patch_conv2d", tuple(linear.shape), config)
    assert shapes == [(dim, 3, side, side)]
    conv = Kimi_K25VisionPatchEmbed(Kimi_K25VisionConfig(hidden_size=dim, patch_size=side)).proj
    with torch.no_grad():
        conv.weight.copy_(fn([linear])[0])
        conv.bias.zero_()
        patches = torch.randn(7, 3, side, side)
        assert torch.allclose(conv(patches).flatten(1), patches.flatten(1) @ linear.T, atol=1e-5)
    with pytest.raises(MergerError, match="vision_config gives patches of 3 channels x 14 x 14"):
        _plan("patch_conv2d", (dim, 12), {})  # transformers' default where config.json says nothing


def test_a_join_names_its_parts_and_they_are_rows_of_no_one_else():
    with pytest.raises(ValueError, match=r"row 'attn.in_proj_q.weight': a cat row joins no tensors"):
        Row("attn.in_proj_q.weight", "cat", ("linear_attn.in_proj_qkv.weight",))
    with pytest.raises(ValueError, match=r"row 'attn.in_proj_z.weight': a rename row names no tensors to join"):
        Row("attn.in_proj_z.weight", "rename", ("linear_attn.in_proj_z.weight",), joined=("attn.in_proj_k.weight",))
    join = Row("attn.in_proj_q.weight", "cat", ("linear_attn.in_proj_qkv.weight",), joined=("attn.in_proj_k.weight",))
    with pytest.raises(ValueError, match=r"row 'attn.in_proj_k.weight' appears twice in the toy family's torchtitan"):
        Family("toy", ("toy",), torchtitan=(join, Row("attn.in_proj_k.weight", "rename", ("k.weight",))))
    with pytest.raises(ValueError, match=r"row 'attn.in_proj_k.weight' of the toy family: a joined tensor is named"):
        Family("toy", ("toy",), torchtitan=(Row("attn.in_proj_k.weight", "joined", reason="by hand"),))
    with pytest.raises(ValueError, match=r"row 'attn.in_proj_q.weight' of the toy family: Megatron rows name weights"):
        Family("toy", ("toy",), megatron=(join,))


def _megatron_cases() -> set[str]:
    """The model types the Megatron logits tests write (test_megatron.py, test_megatron_deepseek.py,
    test_megatron_glm45.py, test_megatron_nemotron_h.py, test_megatron_gpt_oss_minimax.py, test_megatron_dsa.py,
    test_megatron_gdn.py, test_megatron_moe_renames.py, test_megatron_mimo_v2_flash.py, test_megatron_qwen3_vl.py)."""
    from tests import (test_megatron, test_megatron_deepseek, test_megatron_dsa, test_megatron_gdn, test_megatron_glm45,
                       test_megatron_gpt_oss_minimax, test_megatron_mimo_v2_flash, test_megatron_moe_renames,
                       test_megatron_nemotron_h, test_megatron_qwen3_vl)
    from tests.writers import (megatron_checkpoint, megatron_deepseek, megatron_dsa, megatron_gdn,
                               megatron_gpt_oss_minimax, megatron_mimo_v2_flash, megatron_moe_renames,
                               megatron_nemotron_h, megatron_qwen3_vl)

    found = set()
    for cases, names, defaults in ((test_megatron.CASES, test_megatron.MODELS, megatron_checkpoint.DEFAULTS),
                                   (test_megatron_deepseek.CASES, test_megatron_deepseek.CASES,
                                    megatron_deepseek.DEFAULTS),
                                   (test_megatron_glm45.CASES, test_megatron_glm45.CASES,
                                    megatron_deepseek.DEFAULTS),
                                   (test_megatron_nemotron_h.CASES, test_megatron_nemotron_h.CASES,
                                    megatron_nemotron_h.DEFAULTS),
                                   (test_megatron_gpt_oss_minimax.CASES, test_megatron_gpt_oss_minimax.CASES,
                                    megatron_gpt_oss_minimax.DEFAULTS),
                                   (test_megatron_dsa.CASES, test_megatron_dsa.CASES, megatron_dsa.DEFAULTS),
                                   (test_megatron_gdn.CASES, test_megatron_gdn.CASES, megatron_gdn.DEFAULTS),
                                   (test_megatron_moe_renames.CASES, test_megatron_moe_renames.CASES,
                                    megatron_moe_renames.DEFAULTS),
                                   (test_megatron_mimo_v2_flash.CASES, test_megatron_mimo_v2_flash.CASES,
                                    megatron_mimo_v2_flash.DEFAULTS),
                                   (test_megatron_qwen3_vl.CASES, test_megatron_qwen3_vl.CASES,
                                    megatron_qwen3_vl.DEFAULTS)):
        for name in names:
            spec = dict(pair.split("=") for pair in cases[name].split(",") if pair)
            found.add(spec.get("arch", defaults["arch"]))
    return found


def _torchtitan_cases() -> set[str]:
    """The families the tests have torchtitan write: `--family` of tests/writers/torchtitan_checkpoint.py (a
    model type), as a literal in a run_writer call or through tests/helpers' written_by_torchtitan, in a test
    module or a conftest fixture."""
    found = set()
    for path in [*TESTS.glob("test_*.py"), TESTS / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
            called = getattr(node.func, "id", None)
            if called == "written_by_torchtitan":
                found.add(args[1])
            elif called == "run_writer" and args[:1] == ["torchtitan_checkpoint.py"] and "--family" in args:
                found.add(args[args.index("--family") + 1])
    return found - {None}


def _families_of(model_types: set[str]) -> set[str]:
    return {f.name for f in FAMILIES for t in model_types if t in f.model_types}


def test_every_megatron_family_has_a_test_case():
    assert {f.name for f in MEGATRON_FAMILIES} - _families_of(_megatron_cases()) == set()


def test_every_megatron_vision_tower_has_a_test_case():
    """test_megatron_qwen3_vl.py, test_megatron_qwen3_5_vl.py and test_megatron_glm45v.py merge what their writers
    write for each of their cases, whose HF config is the VLM's."""
    from argparse import Namespace

    from tests import test_megatron_glm45v, test_megatron_qwen3_5_vl, test_megatron_qwen3_vl
    from tests.writers import megatron_glm45v, megatron_qwen3_5_vl, megatron_qwen3_vl

    cases = [(test_megatron_qwen3_vl.CASES, megatron_qwen3_vl, {"layers": 2}),
             (test_megatron_qwen3_5_vl.CASES, megatron_qwen3_5_vl, {}),
             (test_megatron_glm45v.CASES, megatron_glm45v, {})]
    written = set()
    for specs, writer, fixed in cases:
        for spec in specs.values():
            values = {**writer.DEFAULTS, **dict(pair.split("=") for pair in spec.split(",") if pair), **fixed}
            written.add(writer.hf_config(Namespace(**values)).model_type)
    towers = {t for f in MEGATRON_FAMILIES if f.megatron_vision for t in f.megatron_vision.model_types}
    assert towers == written


def test_every_torchtitan_family_has_a_test_case():
    assert {f.name for f in TORCHTITAN_FAMILIES} - _families_of(_torchtitan_cases()) == set()


def test_the_parsers_torchtitan_models_are_the_families():
    """--model's choices are named in flags.py, apart from the records (which import torch): in the same order,
    which --help shows."""
    assert TORCHTITAN_MODELS == tuple(MODELS)


def test_records_that_disagree_are_refused():
    from merger.mapping.families import checked_together

    llama, gpt_oss = (next(f for f in FAMILIES if f.name == n) for n in ("llama", "gpt_oss"))
    with pytest.raises(ValueError, match=r"model type 'llama' belongs to families llama and copy"):
        checked_together((llama, Family("copy", ("llama",), megatron=llama.megatron)))
    unsplit = Row("self_attention.linear_gdn_in.weight", "rename", ("linear_attn.in_proj.weight",))
    with pytest.raises(ValueError, match=r"row 'self_attention.linear_gdn_in.weight' of the gdn family: "
                                         r"sources/megatron_tp.py does not say how TP splits it"):
        checked_together((llama, Family("gdn", ("gdn",), megatron=(unsplit,))))
    with pytest.raises(ValueError, match=r"torchtitan families without marks: \['llama', 'copy'\]"):
        checked_together((llama, Family("copy", ("copy",), torchtitan=llama.torchtitan)))
    with pytest.raises(ValueError, match=r"family copy: mark 'attention.sinks' is also a row of gpt_oss"):
        sinks = Row("attention.sinks", "rename", ("self_attn.sinks",))
        checked_together((llama, gpt_oss, Family("copy", ("copy",), torchtitan=(sinks,),
                                                 torchtitan_marks=("attention.sinks",))))


def test_a_megatron_row_is_a_weight():
    with pytest.raises(ValueError, match=r"row 'mlp.router.expert_bias' of the toy family: Megatron rows name weights"):
        Family("toy", ("toy",), megatron=(Row("mlp.router.expert_bias", "skip", reason="no HF equivalent"),))


def test_torchtitan_names_are_the_family_their_marks_say():
    from merger.mapping.torchtitan import family_of, looks_like_torchtitan

    common = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.feed_forward.w1.weight"]
    assert family_of(common, "ckpt").name == "llama"
    assert family_of(common + ["layers.0.attention.k_norm.weight"], "ckpt").name == "qwen3"
    assert family_of(common + ["layers.1.attention.wkv_a.weight"], "ckpt").name == "deepseek_v3"
    # Qwen3.5's mixers are attn.: a Gated DeltaNet layer or a gated full-attention one marks it
    qwen3_5 = ["tok_embeddings.weight", "layers.0.feed_forward.w1.weight"]
    assert family_of(qwen3_5 + ["layers.0.attn.in_proj_q.weight"], "ckpt").name == "qwen3_5"
    assert family_of(qwen3_5 + ["layers.3.attn.wq.weight"], "ckpt").name == "qwen3_5"
    assert looks_like_torchtitan(["layers.2.attn.in_proj_q.weight"])  # a later pipeline stage: no embedding
    with pytest.raises(MergerError, match=r"marks of the qwen3 and deepseek_v3 families \(--model names the family\)"):
        family_of(common + ["layers.0.attention.k_norm.weight", "layers.1.attention.wkv_a.weight"], "ckpt")
