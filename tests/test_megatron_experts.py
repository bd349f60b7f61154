"""Megatron MoE expert layouts (GroupedMLP, TEGroupedMLP, SequentialMLP; expert TP unlike TP) merged to HF.

megatron-core writes every checkpoint (tests/writers/megatron_moe_checkpoint.py, one torchrun launch of 4
gloo ranks), legacy and torch_dist. The oracle is Megatron's own CPU forward: the merged HF model (Qwen3-MoE,
Mixtral) must reproduce its logits (fp32, max abs diff < 1e-4), and the two formats must merge to the same
bytes. GroupedMLP's forward runs through a stand-in for grouped_gemm's `gmm` (no CUDA here), so the grouped
checkpoint is also loaded into a SequentialMLP model, whose forward does not use it, as a check of the oracle.

TEGroupedMLP (Transformer Engine) cannot be built on CPU: its legacy names are written by renaming a
SequentialMLP checkpoint's keys to the ones TE's GroupedLinear saves, `mlp.experts.linear_fc1.weight{i}` (local
expert i; megatron/core/transformer/moe/experts.py, TEGroupedMLP.sharded_state_dict: `f'{name}.weight{i}'`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_here
from tests.helpers.in_process import merge_in_process as merge
from tests.helpers.legacy_copies import edited_copy
from tests.helpers.logits import hf_logits
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow

CASES = {
    # GroupedMLP, TP2 EP2 ETP1: legacy files mp_rank_00_000 and mp_rank_01_001 only, experts whole in each
    "grouped_tp2_ep2_etp1": "arch=qwen3_moe,tp=2,ep=2,etp=1,grouped=1,cross=1",
    # GroupedMLP with expert TP 2: each expert's gated fc1 is [gate_r; up_r] inside a transposed memory view
    "mixtral_grouped_tp2_ep2": "arch=mixtral,tp=2,ep=2,grouped=1",
    # TEGroupedMLP names, ETP1 while the shared expert is split by TP 2, a dense first layer (moe_layer_freq
    # [0, 1]: torch_dist keys per layer)
    "te_grouped_tp2_ep2_etp1": "arch=qwen2_moe,tp=2,ep=2,etp=1,te=1,dense_first=1",
}


@pytest.fixture(scope="session")
def moe_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_moe")
    run_writer("megatron_moe_checkpoint.py", "--out", root,
               *[arg for name, spec in CASES.items() for arg in ("--case", f"{name}:{spec}")], nproc=4)
    return root


@pytest.fixture(scope="session")
def merged_moe(moe_root, tmp_path_factory):
    """merged_moe(case, fmt) -> fp32 HF folder merged from ROOT/case/fmt, built once."""
    cache: dict = {}

    def make(case: str, fmt: str) -> Path:
        if (case, fmt) not in cache:
            out = tmp_path_factory.mktemp(f"{case}_{fmt}") / "hf"
            cache[(case, fmt)] = merge(moe_root / case / fmt, out, "--hf_model_config_path", moe_root / case / "hf",
                                       "--dtype", "float32")
        return cache[(case, fmt)]

    return make


def max_diff(folder: Path, oracle_file: Path) -> float:
    oracle = torch.load(oracle_file, weights_only=True)
    logits = hf_logits(folder, oracle["tokens"], critic=False)
    assert logits.shape == oracle["logits"].shape
    return (logits - oracle["logits"]).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_legacy_merge_reproduces_megatron_logits(case, moe_root, merged_moe):
    assert max_diff(merged_moe(case, "legacy"), moe_root / case / "logits.pt") < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_torch_dist_merge_equals_legacy_merge(case, merged_moe):
    assert_same_weights(merged_moe(case, "dist"), merged_moe(case, "legacy"), None)


def test_grouped_checkpoint_in_a_sequential_model_checks_the_oracle(moe_root, merged_moe):
    """The torch_dist GroupedMLP save, loaded by megatron-core into SequentialMLP experts (no `gmm` stand-in),
    gives the grouped model's logits, and the merge reproduces them."""
    case = "grouped_tp2_ep2_etp1"
    grouped = torch.load(moe_root / case / "logits.pt", weights_only=True)["logits"]
    sequential = torch.load(moe_root / case / "logits_sequential.pt", weights_only=True)["logits"]
    assert (grouped - sequential).abs().max().item() < 1e-6
    assert max_diff(merged_moe(case, "dist"), moe_root / case / "logits_sequential.pt") < 1e-4


def test_expert_tp_layout_writes_only_expert_dp_rank_0_files(moe_root):
    """The layout under test is the one Megatron-LM writes: a file per (TP, EP) pair of expert-DP rank 0."""
    written = sorted(p.name for p in (moe_root / "grouped_tp2_ep2_etp1" / "legacy" / "iter_0000001").iterdir())
    assert written == ["mp_rank_00_000", "mp_rank_01_001"]


def test_missing_expert_tp_rank_file_is_reported(moe_root, tmp_path, capsys):
    case = "grouped_tp2_ep2_etp1"
    src = Path(shutil.copytree(moe_root / case / "legacy", tmp_path / "ckpt"))
    shutil.rmtree(src / "iter_0000001" / "mp_rank_01_001")
    code, (error,) = merge_here(capsys, "--local_dir", src, "--target_dir", tmp_path / "out",
                                "--hf_model_config_path", moe_root / case / "hf")
    assert code == os.EX_NOINPUT
    assert "rank file for tp 1 pp 0 ep 1 is missing" in error, error
    assert not (tmp_path / "out").exists()


def test_unmapped_tensor_is_an_error_naming_it(moe_root, tmp_path, capsys):
    """A stored tensor that no skip rule covers and the family's table cannot name stops the merge."""
    case = "te_grouped_tp2_ep2_etp1"
    src = edited_copy(moe_root / case / "legacy", tmp_path / "ckpt",
                      lambda state: state["model"].update({"decoder.layers.1.mlp.experts.linear_fc3.weight0":
                                                           torch.zeros(4, 4)}))
    code, (error,) = merge_here(capsys, "--local_dir", src, "--target_dir", tmp_path / "out",
                                "--hf_model_config_path", moe_root / case / "hf")
    assert code == 1
    assert "no HF name for Megatron tensor decoder.layers.1.mlp.experts.linear_fc3.weight0" in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_inspect_lists_what_is_skipped_and_why(fmt, moe_root, capsys):
    """Every `_extra_state` entry torch finds in the files is listed, under its rule; nothing else is left out."""
    from torch.distributed.checkpoint import FileSystemReader

    from merger.cli import main

    case = "te_grouped_tp2_ep2_etp1"
    assert main(["inspect", "--local_dir", str(moe_root / case / fmt), "--hf_model_config_path",
                 str(moe_root / case / "hf"), "--json"]) == 0
    skipped = json.loads(capsys.readouterr().out)["skipped"]
    if fmt == "dist":
        stored = FileSystemReader(str(moe_root / case / fmt / "iter_0000001")).read_metadata().state_dict_metadata
        extra = {k for k in stored if "._extra_state" in k}
    else:  # one pipeline stage: layer numbers are global; expert-local `_extra_state` names are TE's, per fc
        extra = {k for f in (moe_root / case / fmt).glob("iter_0000001/mp_rank_*/model_optim_rng.pt")
                 for k in torch.load(f, weights_only=False)["model"] if k.endswith("_extra_state")}
    assert extra and skipped == {k: "extra_state" for k in extra}


def test_merge_ranks_of_expert_tp_files_equal_single_process(moe_root, merged_moe, tmp_path):
    """Two merge ranks open one rank file each: TP shards, grouped experts' strided views and gated halves are
    read on one rank and sent to the other's writer."""
    case = "mixtral_grouped_tp2_ep2"
    run_merger("merge", "--local_dir", moe_root / case / "legacy", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", moe_root / case / "hf", "--dtype", "float32", nproc=2)
    assert_same_weights(tmp_path / "out", merged_moe(case, "legacy"), None)


def test_grouped_experts_without_an_expert_count_are_refused(moe_root, tmp_path, capsys):
    """GroupedMLP's matrices do not say how many experts they hold: without `args.num_experts` the merge stops."""
    case = "grouped_tp2_ep2_etp1"
    src = edited_copy(moe_root / case / "legacy", tmp_path / "ckpt",
                      lambda state: delattr(state["args"], "num_experts"))
    code, (error,) = merge_here(capsys, "--local_dir", src, "--target_dir", tmp_path / "out",
                                "--hf_model_config_path", moe_root / case / "hf")
    assert code == 1
    assert "GroupedMLP tensor decoder.layers.0.mlp.experts.weight1 needs the expert count" in error, error
    assert not (tmp_path / "out").exists()
