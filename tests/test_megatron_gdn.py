"""Qwen3.5 and Qwen3-Next (HF qwen3_5_text, qwen3_5_moe_text, qwen3_next) Megatron checkpoints merged to HF, checked
against Megatron's own forward pass.

megatron-core writes every case at TP2, PP2 or EP2, legacy and torch_dist (tests/writers/megatron_gdn.py, one
torchrun launch of 2 gloo ranks): Gated DeltaNet layers and gated full attention in the order config.json's
layer_types gives, zero-centred norms, a dense MLP or routed experts with a shared expert behind its gate. Oracles: Megatron's CPU logits
against transformers' forward of the merged folder (fp32, max abs diff < 1e-4, the same argmax); the names and
shapes transformers' save_pretrained writes for the same config; legacy and torch_dist merge to the same bytes, as
2 merge ranks and one do. The mutation checks show the logits check catches the mistakes a Gated DeltaNet mapping
can make: two in_proj sections swapped, the gated norm's +1 left out, a query head's gate taken for its query.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_here
from tests.helpers.megatron_mtp_models import (assert_megatron_logits, assert_two_ranks_write_one_process_tensors, load,
                                               logits_of, merged_once, oracle, write_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

CASES = {
    "qwen3_5_tp2": "arch=qwen3_5_text,tp=2,pattern=lfl",  # flat in_proj_qkv / _z / _b / _a, a dense MLP
    "qwen3_5_moe_tp2": "arch=qwen3_5_moe_text,tp=2,moe=1,pattern=lf",  # routed experts and a gated shared expert
    "qwen3_5_moe_ep2": "arch=qwen3_5_moe_text,ep=2,moe=1,pattern=lf",  # 2 experts on each EP rank
    "qwen3_next_tp2": "arch=qwen3_next,tp=2,moe=1,pattern=lfl",  # in_proj_qkvz / in_proj_ba grouped per key head
    "qwen3_next_pp2": "arch=qwen3_next,pp=2,moe=1,pattern=lffl",  # layers renumbered over 2 pipeline stages
}


@pytest.fixture(scope="session")
def gdn_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_gdn", CASES, writer="megatron_gdn.py")


@pytest.fixture(scope="session")
def merged(gdn_root, tmp_path_factory):
    return merged_once(gdn_root, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_reproduces_megatron_logits(case, gdn_root, merged):
    model, unexpected = load(merged(case, "legacy"))
    assert not unexpected
    pattern = dict(p.split("=") for p in CASES[case].split(","))["pattern"]
    assert model.config.layer_types == ["linear_attention" if c == "l" else "full_attention" for c in pattern]
    expected = oracle(gdn_root, case)
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


@pytest.mark.parametrize("case", list(CASES))
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_shapes_are_those_save_pretrained_writes(case, gdn_root, merged, tmp_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(gdn_root / case / "hf")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "own")
    own = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "own").items()}
    assert {n: t.shape for n, t in load_safetensors_folder(merged(case, "legacy")).items()} == own


def test_two_merge_ranks_write_the_one_process_bytes(gdn_root, merged, tmp_path):
    """Under torchrun x2 each rank writes its share of the transformed tensors, in several files: the tensors one
    process writes, bit for bit."""
    case = "qwen3_next_tp2"
    assert_two_ranks_write_one_process_tensors(gdn_root / case / "dist", gdn_root / case / "hf", merged(case, "dist"),
                                               tmp_path / "out")


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    a_copy = a.clone()
    a.copy_(b)
    b.copy_(a_copy)


def _value_z_swapped(weights: dict, config) -> None:
    """The in_proj's value and z sections (the same size) taken for each other."""
    layer = "model.layers.0.linear_attn."
    if config.model_type == "qwen3_next":  # per key head [q, k, v group, z group]
        per_key = weights[layer + "in_proj_qkvz.weight"].view(config.linear_num_key_heads, -1, config.hidden_size)
        qk, vz = 2 * config.linear_key_head_dim, per_key.shape[1] - 2 * config.linear_key_head_dim
        _swap(per_key[:, qk:qk + vz // 2], per_key[:, qk + vz // 2:])
    else:
        qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        _swap(weights[layer + "in_proj_qkv.weight"][qk:], weights[layer + "in_proj_z.weight"])


def _beta_alpha_swapped(weights: dict, config) -> None:
    layer = "model.layers.0.linear_attn."
    if config.model_type == "qwen3_next":  # per key head [b group, a group]
        per_key = weights[layer + "in_proj_ba.weight"].view(config.linear_num_key_heads, 2, -1, config.hidden_size)
        _swap(per_key[:, 0], per_key[:, 1])
    else:
        _swap(weights[layer + "in_proj_b.weight"], weights[layer + "in_proj_a.weight"])


def _gated_norm_without_plus_one(weights: dict, config) -> None:
    weights["model.layers.0.linear_attn.norm.weight"] -= 1


def _query_and_gate_swapped(weights: dict, config) -> None:
    """Each query head's [q, gate] rows of q_proj in the wrong order."""
    layer = config.layer_types.index("full_attention")
    per_head = weights[f"model.layers.{layer}.self_attn.q_proj.weight"].view(config.num_attention_heads, 2, -1)
    _swap(per_head[:, 0], per_head[:, 1])


MUTATIONS = [_value_z_swapped, _beta_alpha_swapped, _gated_norm_without_plus_one, _query_and_gate_swapped]


@pytest.mark.parametrize("case", ["qwen3_5_tp2", "qwen3_next_tp2"])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__.strip("_"))
def test_a_mis_mapped_gated_deltanet_fails_the_logits_check(case, mutation, gdn_root, merged):
    """The merged weights with one Gated DeltaNet mapping mistake put back: the check the merge passes fails."""
    model, _ = load(merged(case, "legacy"))
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    mutation(weights, model.config)
    model.load_state_dict(weights)
    expected = oracle(gdn_root, case)
    with pytest.raises(AssertionError):
        assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


def test_a_config_of_other_deltanet_sizes_is_an_error(gdn_root, tmp_path, capsys):
    """config.json's Gated DeltaNet sizes decide the in_proj split: sizes the checkpoint does not have stop the
    merge, naming the tensor, instead of writing a model that splits the heads wrong."""
    case = "qwen3_next_tp2"
    hf = Path(shutil.copytree(gdn_root / case / "hf", tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    config["linear_value_head_dim"] *= 2
    (hf / "config.json").write_text(json.dumps(config))
    code, errors = merge_here(capsys, "--local_dir", gdn_root / case / "dist", "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", hf)
    assert code == 1 and len(errors) == 1, errors
    assert "self_attention.in_proj.weight has" in errors[0] and "Gated DeltaNet" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_layer_types_the_checkpoint_does_not_have_are_an_error(fmt, gdn_root, tmp_path, capsys):
    """config.json's layer_types decide which HF module each layer is: a pattern other than the checkpoint's
    stops the merge, naming the layer, instead of writing weights the model would not load."""
    case = "qwen3_5_tp2"
    hf = Path(shutil.copytree(gdn_root / case / "hf", tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    config["layer_types"] = ["linear_attention", "linear_attention", "full_attention"]
    (hf / "config.json").write_text(json.dumps(config))
    code, errors = merge_here(capsys, "--local_dir", gdn_root / case / fmt, "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", hf)
    assert code == 1 and len(errors) == 1, errors
    assert "layer 1 of the checkpoint is full_attention but config.json's layer_types[1] is 'linear_attention'" in \
        errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def test_a_qwen3_5_vlm_config_is_refused_naming_the_text_config(gdn_root, tmp_path, capsys):
    """Qwen3.5's HF release is the VLM (model_type qwen3_5, the text model's config under text_config): a Megatron
    text model needs that text_config, and the error says so."""
    case = "qwen3_5_tp2"
    hf = Path(shutil.copytree(gdn_root / case / "hf", tmp_path / "hf"))
    text = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    code, errors = merge_here(capsys, "--local_dir", gdn_root / case / "legacy", "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", hf)
    assert code == 1 and len(errors) == 1, errors
    assert "written as the text model of HF qwen3_5: pass a folder whose config.json is this config's text_config " \
        "(model_type qwen3_5_text or qwen3_5_moe_text)" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
