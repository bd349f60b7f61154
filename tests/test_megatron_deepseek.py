"""DeepSeek-V3-style Megatron checkpoints (MLA, sigmoid router with expert bias, shared experts, a dense first
layer, multi-token prediction) merged to HF, checked against Megatron's own forward pass.

megatron-core writes every checkpoint at TP2, legacy and torch_dist (tests/writers/megatron_deepseek.py, one
torchrun launch of 2 gloo ranks). Oracles: Megatron's CPU logits for the main model (transformers'
DeepseekV3ForCausalLM on the merged folder) and for its MTP layer (transformers' own MtpModel loading the merged
`model.layers.{L}.*`), fp32, max abs diff < 1e-4; the MTP layer's own tensors as the Megatron module holds them,
gathered over TP; legacy and torch_dist merge to the same bytes.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_here, single_error_line
from tests.helpers.in_process import merge_in_process as merge
from tests.helpers.megatron_mtp_models import (assert_megatron_logits, assert_mtp_dropped, assert_mtp_layer_tensors,
                                               load, load_beside_mtp, logits_of, merged_once, mtp_logits, oracle,
                                               write_cases)
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASES = {
    "dsv3_tp2": "tp=2",  # q-LoRA, layers [dense, MoE], one MTP layer
    "dsv3_no_q_lora_tp2": "tp=2,q_lora=0,mtp=0",  # q_proj instead of q_a/q_b; no MTP layer in the checkpoint
    "llama_mtp_tp2": "arch=llama,tp=2,mtp=1",  # MTP layers on a family HF has none for
}
DEEPSEEK = ["dsv3_tp2", "dsv3_no_q_lora_tp2"]


@pytest.fixture(scope="session")
def deepseek_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_deepseek", CASES)


@pytest.fixture(scope="session")
def merged(deepseek_root, tmp_path_factory):
    return merged_once(deepseek_root, tmp_path_factory)


@pytest.mark.parametrize("case", DEEPSEEK)
def test_merge_reproduces_megatron_logits(case, deepseek_root, merged):
    expected = oracle(deepseek_root, case)
    model = load_beside_mtp(merged(case, "legacy"), expected)
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


@pytest.mark.parametrize("case", DEEPSEEK)
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


def test_mtp_layer_reproduces_megatron_mtp_logits(deepseek_root, merged):
    """transformers' MtpModel, loading the merged `model.layers.{L}.*` as it loads DeepSeek-V3's layer 61, predicts
    the token after next as Megatron's MTP layer does."""
    expected = oracle(deepseek_root, "dsv3_tp2")
    model, _ = load(merged("dsv3_tp2", "legacy"))
    assert model.config.num_nextn_predict_layers == 1
    assert_megatron_logits(mtp_logits(model, expected["tokens"]), expected["mtp_logits"][0])


def test_mtp_tensors_are_the_megatron_mtp_module(deepseek_root, merged):
    """The MTP layer's own tensors, gathered over TP from the Megatron module, under DeepSeek-V3's names."""
    assert_mtp_layer_tensors(merged("dsv3_tp2", "legacy"), oracle(deepseek_root, "dsv3_tp2")["mtp_params"], 2)


def test_drop_mtp_leaves_the_mtp_layer_out(deepseek_root, merged, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="merger")
    case = "dsv3_tp2"
    out = merge(deepseek_root / case / "legacy", tmp_path / "out", "--hf_model_config_path", deepseek_root / case / "hf",
                "--dtype", "float32", "--drop-mtp")
    assert "merger: 1 multi-token-prediction layer(s) left out (--drop-mtp)" in caplog.text
    assert_mtp_dropped(out, merged(case, "legacy"), oracle(deepseek_root, case))


def test_checkpoint_without_mtp_sets_no_mtp_layers(deepseek_root, merged):
    """The given config says 1 (DeepseekV3Config's default); the checkpoint holds none, so the output says 0."""
    assert json.loads((deepseek_root / "dsv3_no_q_lora_tp2" / "hf" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    config = json.loads((merged("dsv3_no_q_lora_tp2", "legacy") / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_mtp_layers_a_family_has_no_names_for_are_an_error(fmt, deepseek_root, tmp_path):
    case = "llama_mtp_tp2"
    proc = run_merger("merge", "--local_dir", deepseek_root / case / fmt, "--target_dir", tmp_path / "out",
                      "--hf_model_config_path", deepseek_root / case / "hf", check=False)
    assert proc.returncode == 1
    error = single_error_line(proc.stderr)
    assert "Megatron tensor mtp.layers.0." in error and "--drop-mtp" in error, error
    assert not (tmp_path / "out").exists()


def test_drop_mtp_merges_a_family_without_mtp(deepseek_root, merged):
    """verl's spelling --drop_mtp works too; the Llama loads whole and gives Megatron's logits."""
    import transformers

    case = "llama_mtp_tp2"
    out = merged(case, "legacy", "--drop_mtp")
    assert "num_nextn_predict_layers" not in json.loads((out / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected = oracle(deepseek_root, case)
    with torch.no_grad():
        assert (model.eval()(expected["tokens"]).logits - expected["logits"]).abs().max().item() < 1e-4
    assert_same_weights(merged(case, "dist", "--drop_mtp"), out, None)


# DeepSeek-V3's own release says its weights are FP8 in 128x128 blocks (its config.json on the Hub)
DEEPSEEK_V3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
# a ModelOpt NVFP4 export says so twice: in config.json and in hf_quant_config.json (FORMATS.md)
MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


@pytest.mark.parametrize("release", ["fp8", "modelopt"])
def test_the_config_of_a_quantized_release_gives_a_model_without_its_quantization_config(release, deepseek_root,
                                                                                        merged, tmp_path, caplog):
    """Megatron trains from a quantized release's folder, and that folder is the config handed to the merge: the
    merged weights are plain floats, so quantization_config stays out of config.json (kept, transformers would
    look for the quantized weights and their scales), and ModelOpt's hf_quant_config.json is not copied. The model
    loads and gives Megatron's logits, with the same weights as from a config without them."""
    caplog.set_level(logging.INFO, logger="merger")
    case = "dsv3_tp2"
    hf = Path(shutil.copytree(deepseek_root / case / "hf", tmp_path / "release"))
    config = json.loads((hf / "config.json").read_text())
    qc = DEEPSEEK_V3_FP8 if release == "fp8" else MODELOPT_NVFP4
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    if release == "modelopt":
        (hf / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    out = merge(deepseek_root / case / "legacy", tmp_path / "out", "--hf_model_config_path", hf, "--dtype", "float32")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not (out / "hf_quant_config.json").exists() and (out / "tokenizer_config.json").is_file()
    said = " (and hf_quant_config.json not copied)" if release == "modelopt" else ""
    assert (f"merger: quantization_config of {hf / 'config.json'} left out of config.json{said}: the output holds no "
            "quantized weight") in caplog.text
    assert_same_weights(out, merged(case, "legacy"), None)
    expected = oracle(deepseek_root, case)
    assert_megatron_logits(logits_of(load_beside_mtp(out, expected), expected["tokens"]), expected["logits"])


def test_mla_ranks_that_disagree_with_config_are_an_error(deepseek_root, tmp_path, capsys):
    """A down projection whose rows are not config.json's LoRA rank (another model's config, or a TP layout read
    wrong) stops the merge, naming the tensor, rather than writing a model that cannot load."""
    case = "dsv3_tp2"
    hf = Path(shutil.copytree(deepseek_root / case / "hf", tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "q_lora_rank": config["q_lora_rank"] // 2}))
    code, errors = merge_here(capsys, "--local_dir", deepseek_root / case / "legacy", "--target_dir",
                              tmp_path / "out", "--hf_model_config_path", hf)
    assert code == 1 and len(errors) == 1, errors
    assert "linear_q_down_proj.weight has 24 rows where config.json needs 12" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def _as_te_spec(state: dict, whole: dict[str, torch.Tensor]) -> dict:
    """A local-spec rank's tensors as the TE spec names and holds them: the q/kv norms fused into the up
    projections, a dense layer's pre-MLP norm into fc1, the down projections whole (a duplicated TELinear), and
    the MTP transformer layer under Megatron-Bridge's name."""
    renames = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
               "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    out = {}
    for name, value in state.items():
        if name in whole:
            value = whole[name]
        for old, new in renames.items():
            name = name.replace(old, new)
        if name.endswith("pre_mlp_layernorm.weight") and name.replace("pre_mlp_layernorm", "mlp.linear_fc1") in state:
            name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        out[name.replace(".transformer_layer.", ".mtp_model_layer.")] = value
    return out


def test_te_spec_names_merge_alike(deepseek_root, merged, tmp_path):
    """TE's fused norm names, its whole-on-every-rank MLA down projections and Megatron-Bridge's MTP layer name
    give the same model. Transformer Engine does not build on CPU, so the local-spec rank files are rewritten
    into that layout."""
    case = "dsv3_tp2"
    src = Path(shutil.copytree(deepseek_root / case / "legacy", tmp_path / "te"))
    files = [src / "iter_0000001" / f"mp_rank_0{tp}" / "model_optim_rng.pt" for tp in range(2)]
    states = [torch.load(f, weights_only=False) for f in files]  # our own test files
    whole = {n: torch.cat([s["model"][n] for s in states]) for n in states[0]["model"]
             if n.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight"))}
    assert whole
    for file, state in zip(files, states):
        state["model"] = _as_te_spec(state["model"], whole)
        torch.save(state, file)
    assert any(n.endswith("linear_kv_up_proj.layer_norm_weight") for n in states[0]["model"])
    out = merge(src, tmp_path / "out", "--hf_model_config_path", deepseek_root / case / "hf", "--dtype", "float32")
    assert_same_weights(out, merged(case, "legacy"), None)


def test_mtp_layers_after_a_different_layer_count_are_an_error(deepseek_root, tmp_path, capsys):
    """MTP layers are numbered after config.json's num_hidden_layers: a config that disagrees with the
    checkpoint's decoder layers would misplace them."""
    case = "dsv3_tp2"
    hf = Path(shutil.copytree(deepseek_root / case / "hf", tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    code, errors = merge_here(capsys, "--local_dir", deepseek_root / case / "dist", "--target_dir",
                              tmp_path / "out", "--hf_model_config_path", hf)
    assert code == 1 and len(errors) == 1, errors
    assert "the checkpoint has 2 decoder layers but config.json's num_hidden_layers is 3" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def test_bfloat16_dtypes_are_those_save_pretrained_writes(deepseek_root, merged, tmp_path):
    """--dtype bfloat16 gives each tensor the dtype save_pretrained writes for DeepseekV3ForCausalLM loaded at
    bfloat16 (the oracle loads the float32 merge: transformers alone decides the dtypes): the router's weight and
    expert bias stay float32, with the values Megatron stored."""
    import transformers

    case = "dsv3_tp2"
    bf16 = merge(deepseek_root / case / "legacy", tmp_path / "bf16", "--hf_model_config_path",
                 deepseek_root / case / "hf")
    transformers.AutoModelForCausalLM.from_pretrained(merged(case, "legacy"), dtype=torch.bfloat16).save_pretrained(
        tmp_path / "saved")
    want = {n: t.dtype for n, t in load_safetensors_folder(tmp_path / "saved").items()}
    got, fp32 = load_safetensors_folder(bf16), load_safetensors_folder(merged(case, "legacy"))
    assert {n: got[n].dtype for n in want} == want  # beside them only the MTP layer, which transformers builds not
    kept = [n for n, d in want.items() if d == torch.float32]
    assert kept and all(torch.equal(got[n], fp32[n]) for n in kept)
