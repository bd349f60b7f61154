"""Qwen3.5 and Qwen3-Next (HF qwen3_5_text, qwen3_5_moe_text, qwen3_next) Megatron checkpoints merged to HF, checked
against Megatron's own forward pass.

megatron-core writes every case at TP2, PP2 or EP2, legacy and torch_dist (tests/writers/megatron_gdn.py, one
torchrun launch of 2 gloo ranks): Gated DeltaNet layers and gated full attention in the order config.json's
layer_types gives, zero-centred norms, a dense MLP or routed experts with a shared expert behind its gate, and a
multi-token-prediction layer where `mtp=1`. Oracles: Megatron's CPU logits against transformers' forward of the
merged folder (fp32, max abs diff < 1e-4, the same argmax); the names and shapes transformers' save_pretrained
writes for the same config; legacy and torch_dist merge to the same bytes, as 2 merge ranks and one do. The mutation
checks show the logits check catches the mistakes a Gated DeltaNet mapping can make: two in_proj sections swapped,
the gated norm's +1 left out, a query head's gate taken for its query.

The MTP layer is written as the released checkpoints hold it (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py load it,
transformers ignores `mtp.*`): `mtp.fc` (Megatron's eh_proj), `mtp.pre_fc_norm_embedding` / `_hidden` (enorm,
hnorm), `mtp.layers.0.*` (its transformer layer under the decoder layer's names), `mtp.norm` (its final norm).
transformers has no module for it, so its logits are computed here as vLLM's forward runs it, from transformers'
own decoder layer and norm on the merged tensors: norm the next token's embedding and the model's last hidden
state, fc over [embedding; hidden], the layer, the norm, lm_head; they must be the logits Megatron's MTP layer gives.
Its own tensors are also checked one by one against Megatron's MTP module (the writer's `mtp_params`).
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.helpers.in_process import merge_here
from tests.helpers.megatron_mtp_models import (assert_megatron_logits, assert_ranks_write_one_process_files, load,
                                               logits_of, merged_once, oracle, write_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASES = {
    "qwen3_5_tp2": "arch=qwen3_5_text,tp=2,pattern=lfl",  # flat in_proj_qkv / _z / _b / _a, a dense MLP
    "qwen3_5_moe_tp2": "arch=qwen3_5_moe_text,tp=2,moe=1,pattern=lf",  # routed experts and a gated shared expert
    "qwen3_5_moe_ep2": "arch=qwen3_5_moe_text,ep=2,moe=1,pattern=lf",  # 2 experts on each EP rank
    "qwen3_next_tp2": "arch=qwen3_next,tp=2,moe=1,pattern=lfl",  # in_proj_qkvz / in_proj_ba grouped per key head
    "qwen3_next_pp2": "arch=qwen3_next,pp=2,moe=1,pattern=lffl",  # layers renumbered over 2 pipeline stages
    # a multi-token-prediction layer: its full attention and MoE split over TP, or its experts over EP
    "qwen3_next_mtp_tp2": "arch=qwen3_next,tp=2,moe=1,pattern=lfl,mtp=1",
    "qwen3_5_mtp_tp2": "arch=qwen3_5_text,tp=2,pattern=lf,mtp=1",
    "qwen3_5_moe_mtp_ep2": "arch=qwen3_5_moe_text,ep=2,moe=1,pattern=lf,mtp=1",
    # the MTP layer on the last pipeline stage, beside that stage's copy of the embedding
    "qwen3_5_mtp_pp2": "arch=qwen3_5_text,pp=2,pattern=lf,mtp=1",
}
MTP_CASES = [case for case, spec in CASES.items() if "mtp=1" in spec]
TWO_MTP = {"qwen3_5_mtp2": "arch=qwen3_5_text,pattern=lf,mtp=2"}  # more MTP layers than HF's layout holds
# Megatron's MTP layer's own tensors -> the released checkpoints' names
MTP_OWN = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
           "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "final_layernorm.weight": "mtp.norm.weight"}
MTP_COUNT = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5_text": "mtp_num_hidden_layers",
             "qwen3_5_moe_text": "mtp_num_hidden_layers"}


@pytest.fixture(scope="session")
def gdn_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_gdn", {**CASES, **TWO_MTP}, writer="megatron_gdn.py")


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
    """The model's tensors are those save_pretrained writes; an MTP layer's transformer layer has the names and
    shapes save_pretrained gives a full-attention decoder layer."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(gdn_root / case / "hf")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "own")
    own = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "own").items()}
    got = {n: t.shape for n, t in load_safetensors_folder(merged(case, "legacy")).items()}
    assert {n: s for n, s in got.items() if not n.startswith("mtp.")} == own
    full = f"model.layers.{config.layer_types.index('full_attention')}."
    assert {n[len("mtp.layers.0."):]: s for n, s in got.items() if n.startswith("mtp.layers.")} == (
        {n[len(full):]: s for n, s in own.items() if n.startswith(full)} if case in MTP_CASES else {})


@pytest.mark.parametrize("case, fmt, nproc", [("qwen3_next_mtp_tp2", "dist", 2), ("qwen3_5_moe_mtp_ep2", "legacy", 3)])
def test_merge_ranks_write_the_one_process_bytes(case, fmt, nproc, gdn_root, tmp_path):
    """Under torchrun x2 and x3 each rank writes its share of the transformed tensors (the MTP layer's too, and with
    3 ranks the experts of both EP files), in several files: the files one process writes, byte for byte."""
    assert_ranks_write_one_process_files(gdn_root / case / fmt, gdn_root / case / "hf", tmp_path / "out", nproc)


def mtp_logits(folder: Path, tokens: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """The MTP layer's logits as vLLM's Qwen3-Next / Qwen3.5 MTP forward computes them, from transformers' modules:
    its transformer layer is the decoder layer transformers loads from `mtp.layers.0.*` put in place of a
    full-attention layer's tensors, run with what that layer gets in the model's forward (rotary, mask); its norms
    are the model's norm with the `mtp.*` weights. Fed as Megatron feeds its MTP layer: token i + 1's embedding at
    position i, a 0 rolled in at the end."""
    model, unexpected = load(folder)
    assert not unexpected  # transformers ignores mtp.*
    weights = load_safetensors_folder(folder)
    full = f"model.layers.{model.config.layer_types.index('full_attention')}."
    twin = {n: t for n, t in weights.items() if not n.startswith((full, "mtp."))}
    twin.update({full + n[len("mtp.layers.0."):]: t for n, t in weights.items() if n.startswith("mtp.layers.0.")})
    save_file(twin, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    layer = load(tmp_path)[0].get_submodule(full.rstrip("."))
    seen = {}
    hook = model.get_submodule(full.rstrip(".")).register_forward_pre_hook(lambda m, a, kw: seen.update(kw),
                                                                            with_kwargs=True)

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        own = copy.deepcopy(model.model.norm)
        own.weight.copy_(weights[name])
        return own(x)

    with torch.no_grad():
        hidden = model.model(tokens, use_cache=False).last_hidden_state
        hook.remove()
        shifted = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        joined = torch.cat([norm("mtp.pre_fc_norm_embedding.weight", model.model.embed_tokens(shifted)),
                            norm("mtp.pre_fc_norm_hidden.weight", hidden)], dim=-1)
        out = layer(F.linear(joined, weights["mtp.fc.weight"]), **seen)
        return model.lm_head(norm("mtp.norm.weight", out[0] if isinstance(out, tuple) else out))


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_layer_reproduces_megatron_mtp_logits(case, gdn_root, merged, tmp_path):
    expected = oracle(gdn_root, case)
    assert_megatron_logits(mtp_logits(merged(case, "legacy"), expected["tokens"], tmp_path), expected["mtp_logits"][0])


def _fc_halves_swapped(folder: Path, tmp_path: Path) -> Path:
    """The merged folder with mtp.fc's [embedding; hidden] halves taken in the wrong order."""
    weights = load_safetensors_folder(folder)
    weights["mtp.fc.weight"] = torch.cat(weights["mtp.fc.weight"].chunk(2, dim=1)[::-1], dim=1)
    out = tmp_path / "swapped"
    out.mkdir()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", out / "config.json")
    return out


def test_an_mtp_fc_in_the_wrong_order_fails_the_mtp_logits_check(gdn_root, merged, tmp_path):
    case = "qwen3_next_mtp_tp2"
    expected = oracle(gdn_root, case)
    (tmp_path / "twin").mkdir()
    logits = mtp_logits(_fc_halves_swapped(merged(case, "legacy"), tmp_path), expected["tokens"], tmp_path / "twin")
    with pytest.raises(AssertionError):
        assert_megatron_logits(logits, expected["mtp_logits"][0])


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_tensors_are_the_megatron_mtp_module(case, gdn_root, merged):
    """The MTP layer's own tensors, as the writer gathered them from megatron-core's module, under the released
    names; config.json counts the one layer under the key its family's HF configs use."""
    expected = oracle(gdn_root, case)["mtp_params"]
    weights = load_safetensors_folder(merged(case, "legacy"))
    assert sorted(expected) == sorted(f"mtp.layers.0.{n}" for n in MTP_OWN)
    for megatron, hf in MTP_OWN.items():
        assert torch.equal(weights[hf], expected[f"mtp.layers.0.{megatron}"]), hf
    config = json.loads((merged(case, "legacy") / "config.json").read_text())
    assert config[MTP_COUNT[config["model_type"]]] == 1


@pytest.mark.parametrize("case", MTP_CASES)
def test_drop_mtp_leaves_the_mtp_layer_out(case, gdn_root, merged):
    """--drop-mtp writes the model without its MTP layer: every other tensor the same bytes, config.json counts no
    MTP layer, and the model gives Megatron's logits."""
    out, whole = merged(case, "dist", "--drop-mtp"), load_safetensors_folder(merged(case, "dist"))
    got = load_safetensors_folder(out)
    assert sorted(got) == sorted(n for n in whole if not n.startswith("mtp."))
    assert all(torch.equal(t, whole[n]) for n, t in got.items())
    config = json.loads((out / "config.json").read_text())
    assert config[MTP_COUNT[config["model_type"]]] == 0
    expected = oracle(gdn_root, case)
    assert_megatron_logits(logits_of(load(out)[0], expected["tokens"]), expected["logits"])


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_two_mtp_layers_are_an_error_and_drop_mtp_merges_the_model(fmt, gdn_root, merged, tmp_path, capsys):
    """HF keeps one mtp.fc and one set of MTP norms; Megatron's 2 MTP layers have one each: the merge stops, naming
    why and --drop-mtp, which then writes the model without them."""
    case = "qwen3_5_mtp2"
    code, errors = merge_here(capsys, "--local_dir", gdn_root / case / fmt, "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", gdn_root / case / "hf")
    assert code == 1 and len(errors) == 1, errors
    assert "the checkpoint has 2 multi-token-prediction layers" in errors[0] and "--drop-mtp" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
    expected = oracle(gdn_root, case)
    model, _ = load(merged(case, fmt, "--drop-mtp"))
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


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
    assert "written as the text model of HF qwen3_5: pass a folder whose config.json is this config's text_config, " \
        "its model_type qwen3_5_text or qwen3_5_moe_text" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
