"""DeepSeek-V3.2 and GLM-5 Megatron checkpoints (DeepSeek Sparse Attention: MLA with the lightning indexer, DeepSeek's
MoE, multi-token prediction) merged to HF, checked against Megatron's own forward pass.

megatron-core 0.19.2 writes both at TP2 as torch_dist and legacy (tests/writers/megatron_dsa.py, one torchrun launch
of 2 gloo ranks from the Python 3.12 writer venv, tests/helpers/writers312.py). GLM-5's MLA down projections are
the DSA spec's own, whole on every TP rank (as TE's spec holds them), DeepSeek-V3.2's column-parallel: a legacy
file does not say which, and both are merged from it. Oracles: Megatron's CPU logits against
transformers' DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM on the merged folder (fp32, max abs diff < 1e-4, the
same argmax), with an indexer that keeps 4 of the 8 tokens, so the logits depend on it; the names and shapes
save_pretrained writes for the same config; the MTP layer's own tensors as the Megatron module holds them.
transformers 5.24 has no MTP model for these two types (MtpModel needs `num_mtp_layers` and `mtp_layer_types` in
their configs), so the MTP layer's logits are not checked: its transformer layer is mapped by the same rows as the
decoder layers the logits check.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.megatron_mtp_models import (assert_megatron_logits, assert_mtp_dropped, assert_mtp_layer_tensors,
                                               assert_ranks_write_one_process_files, load_beside_mtp, logits_of,
                                               merged_once, oracle)
from tests.helpers.processes import run_writer
from tests.helpers.weights import load_safetensors_folder
from tests.helpers.writers312 import writers312_python

pytestmark = pytest.mark.slow

CASES = {
    "dsv32_tp2": "tp=2",  # layers [dense, MoE], routing groups, one MTP layer; half-split RoPE in the indexer
    # the same with GLM-5's interleaved RoPE in the indexer, one group, and the q/kv down projections whole
    "glm5_tp2": "arch=glm_moe_dsa,tp=2,down=linear",
    # GLM-5's shared indexer layers: layers 0 and 2 run theirs, layer 1 reuses layer 0's choice; no MTP layer
    "glm5_shared_tp2": "arch=glm_moe_dsa,tp=2,layers=3,share=2,mtp=0",
}
MTP = ["dsv32_tp2", "glm5_tp2"]
LEGACY = ["dsv32_tp2", "glm5_tp2"]  # column-parallel and whole MLA down projections


@pytest.fixture(scope="session")
def dsa_root(tmp_path_factory) -> Path:
    python = writers312_python()
    root = tmp_path_factory.mktemp("megatron_dsa")
    run_writer("megatron_dsa.py", "--out", root, *[arg for case, spec in CASES.items()
                                                  for arg in ("--case", f"{case}:{spec}")], nproc=2, python=python)
    return root


@pytest.fixture(scope="session")
def merged(dsa_root, tmp_path_factory):
    return merged_once(dsa_root, tmp_path_factory)


@pytest.mark.parametrize("case, fmt", [(case, "dist") for case in CASES] + [(case, "legacy") for case in LEGACY])
def test_merge_reproduces_megatron_logits(case, fmt, dsa_root, merged):
    expected = oracle(dsa_root, case)
    model = load_beside_mtp(merged(case, fmt), expected)
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


def test_the_indexer_decides_the_logits(dsa_root, merged):
    """With every key kept, transformers' logits leave Megatron's: the check above needs the indexer's tensors
    where they belong, not only MLA's."""
    expected = oracle(dsa_root, "dsv32_tp2")
    model = load_beside_mtp(merged("dsv32_tp2", "dist"), expected)
    indexers = [m for m in model.modules() if hasattr(m, "index_topk")]
    assert indexers
    for indexer in indexers:
        indexer.index_topk = expected["tokens"].shape[1]
    assert (logits_of(model, expected["tokens"]) - expected["logits"]).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_names_and_shapes_are_those_save_pretrained_writes(case, dsa_root, merged, tmp_path):
    """Without its MTP layer (which transformers builds not) the merge holds what transformers' own class saves
    for the same config, name for name and shape for shape."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(dsa_root / case / "hf")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "saved")
    want = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "saved").items()}
    got = {n: t.shape for n, t in load_safetensors_folder(merged(case, "dist", "--drop-mtp")).items()}
    assert got == want


@pytest.mark.parametrize("case", MTP)
def test_mtp_tensors_are_the_megatron_mtp_module(case, dsa_root, merged):
    assert_mtp_layer_tensors(merged(case, "dist"), oracle(dsa_root, case)["mtp_params"], 2)


@pytest.mark.parametrize("case", MTP)
def test_drop_mtp_leaves_the_mtp_layer_out(case, dsa_root, merged):
    assert_mtp_dropped(merged(case, "dist", "--drop-mtp"), merged(case, "dist"), oracle(dsa_root, case))


def test_bfloat16_dtypes_are_those_save_pretrained_writes(dsa_root, merged, tmp_path):
    """--dtype bfloat16 gives each tensor the dtype save_pretrained writes for DeepseekV32ForCausalLM loaded at
    bfloat16 (the router and its expert bias stay float32, with Megatron's values; the indexer's weights_proj, kept
    in float32 only at float16, does not)."""
    import transformers

    case = "dsv32_tp2"
    bf16 = merged(case, "dist", "--drop-mtp", "--dtype", "bfloat16")
    transformers.AutoModelForCausalLM.from_pretrained(merged(case, "dist", "--drop-mtp"),
                                                      dtype=torch.bfloat16).save_pretrained(tmp_path / "saved")
    want = {n: t.dtype for n, t in load_safetensors_folder(tmp_path / "saved").items()}
    got, fp32 = load_safetensors_folder(bf16), load_safetensors_folder(merged(case, "dist", "--drop-mtp"))
    assert {n: t.dtype for n, t in got.items()} == want
    kept = [n for n, d in want.items() if d == torch.float32]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in kept
    assert all(torch.equal(got[n], fp32[n]) for n in kept)


def test_two_merge_ranks_write_the_one_process_bytes(dsa_root, tmp_path):
    """On two merge ranks each rank writes its share (the indexer's rows, MLA, experts, the MTP layer), in several
    files: the files one process writes, byte for byte."""
    case = "glm5_tp2"
    assert_ranks_write_one_process_files(dsa_root / case / "dist", dsa_root / case / "hf", tmp_path / "out", 2)
