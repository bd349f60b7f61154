"""MiMo-V2-Flash (HF mimo_v2_flash) Megatron checkpoints merged to HF, checked against Megatron's own forward pass.

tests/writers/megatron_mimo_v2_flash.py writes it with megatron-core 0.19.2 at TP 2 and EP 2 (expert TP 1), legacy
and torch_dist (hetereogenous_dist_checkpoint), with Megatron-Bridge's MiMo attention rebuilt on the local spec: a
full-attention dense layer, a sliding-window MoE layer with twice the key-value heads and sinks (split over TP,
each half drawn apart), a full-attention MoE layer; values narrower than the q/k heads and scaled; a RoPE base per
layer type; a sigmoid router whose expert bias steers the choice, no shared expert.
Oracles: Megatron's CPU logits against transformers' forward of the merged folder (fp32, max abs diff < 1e-4, the
same argmax); the names and shapes transformers' save_pretrained writes for the same config, and at bfloat16 its dtypes; legacy and torch_dist
merge to the same bytes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_here, merge_in_process
from tests.helpers.megatron_mtp_models import (assert_loads_with_megatron_logits, merged_once, oracle,
                                               saved_by_transformers, write_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.helpers.writers312 import writers312_python

pytestmark = pytest.mark.slow

CASE = "mimo_v2_flash_tp2_ep2"
CASES = {CASE: "arch=mimo_v2_flash"}  # TP 2, EP 2: the writer's defaults


@pytest.fixture(scope="session")
def mimo_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_mimo_v2_flash", CASES,
                       writer="megatron_mimo_v2_flash.py", python=writers312_python())


@pytest.fixture(scope="session")
def merged(mimo_root, tmp_path_factory):
    return merged_once(mimo_root, tmp_path_factory)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_merge_reproduces_megatron_logits(fmt, mimo_root, merged):
    assert_loads_with_megatron_logits(merged(CASE, fmt), oracle(mimo_root, CASE))


def test_torch_dist_merge_equals_legacy_merge(merged):
    assert_same_weights(merged(CASE, "dist"), merged(CASE, "legacy"), None)


def test_names_and_shapes_are_those_save_pretrained_writes(mimo_root, merged, tmp_path):
    own = saved_by_transformers(mimo_root / CASE / "hf", tmp_path / "own")
    ours = load_safetensors_folder(merged(CASE, "legacy"))
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in own.items()}
    assert "model.layers.1.self_attn.attention_sink_bias" in ours  # the sliding-window layer's sinks, its alone
    assert not any(n.startswith("model.layers.0.self_attn.") and "sink" in n for n in ours)


def test_bfloat16_dtypes_are_those_transformers_writes(mimo_root, tmp_path):
    """At bfloat16 the routers and their expert bias stay float32, as transformers keeps them."""
    out = merge_in_process(mimo_root / CASE / "dist", tmp_path / "bf16", "--hf_model_config_path", mimo_root / CASE / "hf",
                           "--dtype", "bfloat16")
    own = saved_by_transformers(mimo_root / CASE / "hf", tmp_path / "own", torch.bfloat16)
    assert {n: t.dtype for n, t in load_safetensors_folder(out).items()} == {n: t.dtype for n, t in own.items()}
    assert own["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_a_config_whose_layer_types_are_not_the_checkpoints_fails_naming_the_tensor(mimo_root, tmp_path, capsys):
    """Layer 1 given as full attention: its fused QKV holds twice the key-value heads that type has."""
    hf = shutil.copytree(mimo_root / CASE / "hf", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * 3
    (hf / "config.json").write_text(json.dumps(config))
    code, errors = merge_here(capsys, "--local_dir", mimo_root / CASE / "dist", "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", hf)
    assert code != 0
    assert errors == ["merger: error: tensor decoder.layers.1.self_attention.linear_qkv.weight has 224 rows; 8 heads "
                      "in 2 query groups of head dim 16 and values 8 wide need 176 (check config.json)"]
    assert not (tmp_path / "out" / "config.json").exists()
