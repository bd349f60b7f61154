"""GLM-4.5 / 4.6 (HF glm4_moe) Megatron checkpoints merged to HF, checked against Megatron's own forward pass.

megatron-core writes every case at TP2 or EP2, legacy and torch_dist (tests/writers/megatron_deepseek.py with
arch=glm4_moe, one torchrun launch of 2 gloo ranks): GQA attention with qkv bias, half-rotary heads wider than
hidden / heads, a dense first layer then DeepSeek-V3's MoE (sigmoid router whose expert bias steers the choice,
scaled top-k weights, a shared expert). Oracles: Megatron's CPU logits for the main model (transformers'
Glm4MoeForCausalLM on the merged folder) and for its MTP layer (transformers' MtpModel loading the merged
`model.layers.{L}.*`), fp32, max abs diff < 1e-4 with the same argmax; the names and shapes transformers'
save_pretrained writes for the same config; legacy and torch_dist merge to the same bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.megatron_mtp_models import (assert_megatron_logits, assert_mtp_dropped, load, load_beside_mtp,
                                               logits_of, merged_once, mtp_logits, oracle, write_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASES = {
    "glm45_tp2": "arch=glm4_moe,tp=2,qk_norm=1",  # GLM-4.5's q/k norms; one MTP layer
    "glm45_no_qk_norm_tp2": "arch=glm4_moe,tp=2,qk_norm=0,mtp=0",  # use_qk_norm false; no MTP layer
    "glm45_ep2": "arch=glm4_moe,ep=2,qk_norm=1",  # 2 experts on each EP rank, the MTP layer's too
}
WITH_MTP = ["glm45_tp2", "glm45_ep2"]


@pytest.fixture(scope="session")
def glm_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_glm45", CASES)


@pytest.fixture(scope="session")
def merged(glm_root, tmp_path_factory):
    return merged_once(glm_root, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_reproduces_megatron_logits(case, glm_root, merged):
    expected = oracle(glm_root, case)
    model = load_beside_mtp(merged(case, "legacy"), expected)
    assert model.config.use_qk_norm == ("qk_norm=1" in CASES[case])
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


@pytest.mark.parametrize("case", list(CASES))
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_shapes_are_those_save_pretrained_writes(case, glm_root, merged, tmp_path):
    """Beside the MTP layer (which transformers builds no module for), the merge holds exactly the tensors
    transformers' own save_pretrained writes for the same config, in the same shapes."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(glm_root / case / "hf")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "own")
    own = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "own").items()}
    mtp_layer = f"model.layers.{config.num_hidden_layers}."
    ours = {n: t.shape for n, t in load_safetensors_folder(merged(case, "legacy")).items()
            if not n.startswith(mtp_layer)}
    assert ours == own


@pytest.mark.parametrize("case", WITH_MTP)
def test_mtp_layer_reproduces_megatron_mtp_logits(case, glm_root, merged):
    """transformers' MtpModel, loading the merged `model.layers.{L}.*` as it loads GLM-4.5's layer 92, predicts
    the token after next as Megatron's MTP layer does."""
    expected = oracle(glm_root, case)
    model, _ = load(merged(case, "legacy"))
    assert model.config.num_nextn_predict_layers == 1
    assert_megatron_logits(mtp_logits(model, expected["tokens"]), expected["mtp_logits"][0])


def test_drop_mtp_leaves_the_mtp_layer_out(glm_root, merged):
    case = "glm45_tp2"
    assert_mtp_dropped(merged(case, "legacy", "--drop-mtp"), merged(case, "legacy"), oracle(glm_root, case))


def test_checkpoint_without_mtp_sets_no_mtp_layers(glm_root, merged):
    """The given config says 1 (Glm4MoeConfig's default); the checkpoint holds none, so the output says 0."""
    case = "glm45_no_qk_norm_tp2"
    assert json.loads((glm_root / case / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert json.loads((merged(case, "legacy") / "config.json").read_text())["num_nextn_predict_layers"] == 0
