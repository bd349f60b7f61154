"""Launching merges: through Slurm (the submitit launcher and slurm/merge.sbatch) on a real cluster that
slurm/local/up.sh brings up on this machine with two slurmd's posing as two nodes, so every Slurm merge
here is a two-node merge; and as a local gloo group (`launcher local`). The oracle is the model's own
weights (save_pretrained's output), as in the engine's tests."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_same_weights, run

SLURM_BINARIES = ("sbatch", "slurmctld", "slurmd", "munged")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running two-node Slurm cluster for the session; taken down afterwards if this fixture started it."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # daemons live in sbin
    missing = [b for b in SLURM_BINARIES if not shutil.which(b, path=path)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    up = subprocess.run(["bash", ROOT / "slurm/local/up.sh"], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, SLURM_LOCAL_NODES="2"))
    assert up.returncode == 0, f"slurm/local/up.sh failed:\n{up.stdout}\n{up.stderr}"
    yield
    if "already up" not in up.stdout:
        subprocess.run(["bash", ROOT / "slurm/local/down.sh"], capture_output=True, timeout=60)


def launcher(*args, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "launcher", *map(str, args)], timeout=300, check=check)


def merge_args(actor: Path, target: Path) -> list:
    return ["merge", "--local_dir", actor, "--target_dir", target]


def test_launcher_slurm_merges_with_a_task_on_each_of_two_nodes(slurm_cluster, fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint()
    logs = tmp_path / "logs"
    proc = launcher("slurm", "--nodes", 2, "--tasks-per-node", 1, "--cpu", "--folder", logs / "%j", "--",
                    *merge_args(actor, tmp_path / "out"))
    assert "COMPLETED" in proc.stdout
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    # The two tasks ran on different nodes (submitit logs where each started) and formed one group of two
    # merge ranks (rank 0 logs the plan).
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    job_dir = logs / job_id
    for task in (0, 1):
        assert f"node={task}(2), global_rank={task}(2)" in (job_dir / f"{job_id}_{task}_log.out").read_text()
    assert "2 merge ranks" in (job_dir / f"{job_id}_0_log.err").read_text()


def test_sbatch_template_merges_with_torchrun_on_two_nodes(slurm_cluster, fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint()
    log = tmp_path / "job.out"
    run(["sbatch", "--wait", "--nodes", "2", f"--export=ALL,NPROC_PER_NODE=1,PYTHON={sys.executable}",
         "--output", log, ROOT / "slurm/merge.sbatch", *merge_args(actor, tmp_path / "out"), "--device", "cpu"],
        timeout=300)
    assert "2 merge ranks" in log.read_text()
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


@pytest.fixture(scope="module")
def broken_checkpoint(fsdp_checkpoint, tmp_path_factory) -> tuple[Path, str]:
    """A copy of the FSDP checkpoint whose last rank file is gone: a bad input the merger must refuse."""
    actor, _ = fsdp_checkpoint()
    broken = tmp_path_factory.mktemp("broken") / "actor"
    shutil.copytree(actor, broken)
    missing = sorted(broken.glob("model_world_size_*_rank_*.pt"))[-1]
    missing.unlink()
    return broken, missing.name


def test_launcher_slurm_reports_a_failed_merge(slurm_cluster, broken_checkpoint, tmp_path):
    broken, missing = broken_checkpoint
    proc = launcher("slurm", "--nodes", 2, "--cpu", "--folder", tmp_path / "logs" / "%j", "--",
                    *merge_args(broken, tmp_path / "out"), check=False)
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout
    assert "merger: error:" in proc.stderr and missing in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_launcher_local_merges_as_a_gloo_group(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint()
    proc = launcher("local", "--nproc", 2, "--", *merge_args(actor, tmp_path / "out"))
    assert "2 merge ranks" in proc.stderr
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


def test_launcher_local_fails_when_the_merge_fails(broken_checkpoint, tmp_path):
    broken, missing = broken_checkpoint
    proc = launcher("local", "--nproc", 2, "--", *merge_args(broken, tmp_path / "out"), check=False)
    assert proc.returncode == 1
    assert "merger: error:" in proc.stderr and missing in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
