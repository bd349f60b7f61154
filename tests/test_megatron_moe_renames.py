"""ERNIE-4.5-MoE (HF ernie4_5_moe), OLMoE (olmoe) and Hunyuan v3 (hy_v3) Megatron checkpoints merged to HF, checked
against Megatron's own forward pass: families that rename what merger already reads.

megatron-core 0.19.2 writes each model at TP 2 and EP 2 (expert TP 1), legacy and torch_dist
(tests/writers/megatron_moe_renames.py, one torchrun launch of 2 gloo ranks from the Python 3.12 writer venv):
- ERNIE-4.5-MoE: interleaved RoPE, a dense first layer, a softmax router (no correction bias: megatron-core takes
  none with softmax scores, so the merge writes HF's `moe_statics.e_score_correction_bias` as 0), a shared expert;
- OLMoE: q/k norms across all heads, split over TP with the heads, each TP half drawn apart; the softmax over all
  experts, not renormalised;
- Hunyuan v3: per-head q/k norms, a dense first layer, a sigmoid router whose expert bias steers the choice, a
  shared expert, under the release's names (`mlp.router.gate`, `mlp.expert_bias`, `mlp.shared_mlp`).
Oracles: Megatron's CPU logits against transformers' forward of the merged folder (fp32, max abs diff < 1e-4, the
same argmax); the names and shapes transformers' save_pretrained writes for the same config, and at bfloat16 the
dtypes it writes (the routers' float32 tensors); legacy and torch_dist merge to the same bytes.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_in_process
from tests.helpers.megatron_mtp_models import (assert_loads_with_megatron_logits, merged_once, oracle,
                                               saved_by_transformers, write_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.helpers.writers312 import writers312_python

pytestmark = pytest.mark.slow

CASES = {
    "ernie4_5_moe_tp2_ep2": "arch=ernie4_5_moe",
    "olmoe_tp2_ep2": "arch=olmoe",
    "hy_v3_tp2_ep2": "arch=hy_v3",
}


@pytest.fixture(scope="session")
def renames_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_moe_renames", CASES, writer="megatron_moe_renames.py",
                       python=writers312_python())


@pytest.fixture(scope="session")
def merged(renames_root, tmp_path_factory):
    return merged_once(renames_root, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_reproduces_megatron_logits(case, renames_root, merged):
    assert_loads_with_megatron_logits(merged(case, "legacy"), oracle(renames_root, case))


@pytest.mark.parametrize("case", list(CASES))
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_shapes_are_those_save_pretrained_writes(case, renames_root, merged, tmp_path):
    own = saved_by_transformers(renames_root / case / "hf", tmp_path / "own")
    ours = load_safetensors_folder(merged(case, "legacy"))
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in own.items()}


def test_ernie_correction_bias_is_zero_and_float32_as_transformers_keeps_it(renames_root, tmp_path):
    """At bfloat16 each tensor has the dtype transformers' own save of the model at bfloat16 gives it (the router and
    its correction bias float32), and the correction bias Megatron's softmax router has none of is 0."""
    case = "ernie4_5_moe_tp2_ep2"
    out = merge_in_process(renames_root / case / "dist", tmp_path / "bf16", "--hf_model_config_path",
                           renames_root / case / "hf", "--dtype", "bfloat16")
    own = saved_by_transformers(renames_root / case / "hf", tmp_path / "own", torch.bfloat16)
    weights = load_safetensors_folder(out)
    assert {n: t.dtype for n, t in weights.items()} == {n: t.dtype for n, t in own.items()}
    bias = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    assert own[bias].dtype == torch.float32
    assert torch.equal(weights[bias], torch.zeros(1, 4))
