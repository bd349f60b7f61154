"""Launching merges: through Slurm (the submitit launcher and slurm/merge.sbatch) on a real cluster that
slurm/local/up.sh brings up on this machine with two slurmd's posing as two nodes, so every Slurm merge
here is a two-node merge; and as a local gloo group (`launcher local`). The oracle is the model's own
weights (save_pretrained's output), as in the engine's tests.

The cluster lives in a folder of the session's temp directory (its own slurm.conf, munge key, state, ports)
and only the tests' processes see it, through SLURM_CONF in their environment: nothing of the machine's own
Slurm setup is read or written. A cluster the user points at with SLURM_CONF is used instead."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import ROOT
from tests.helpers.processes import run
from tests.helpers.weights import assert_same_weights

# One cluster per run (`make test`'s --dist loadfile keeps a module on one worker). The launcher's pickled job runs under the venv's own
# interpreter on the nodes, so the second interpreter runs these too.
pytestmark = [pytest.mark.infra, pytest.mark.slow, pytest.mark.interpreter]

SLURM_BINARIES = ("sbatch", "slurmctld", "slurmd", "munged")
NODES = 2


def _answers(env: dict) -> bool:
    """A Slurm controller answers under this environment (SLURM_CONF, or the machine's default config)."""
    try:
        return subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free ports on the loopback, for the controller and the slurmds."""
    for base in range(16817, 30000, count + 3):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    pytest.skip(f"no {count} consecutive free ports between 16817 and 30000 for the test cluster")


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    """{"SLURM_CONF": ...} of a running two-node Slurm cluster, for the tests' processes only: the cluster the
    user named with SLURM_CONF, else a private one started in a temp folder and taken down afterwards."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # daemons live in sbin
    missing = [b for b in SLURM_BINARIES if not shutil.which(b, path=path)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    if os.environ.get("SLURM_CONF"):
        if not _answers(dict(os.environ)):
            pytest.skip(f"SLURM_CONF={os.environ['SLURM_CONF']} is set, but its controller does not answer")
        yield {"SLURM_CONF": os.environ["SLURM_CONF"]}
        return
    if _answers(dict(os.environ)):
        pytest.skip("a Slurm cluster already answers here with the machine's own config: not starting a test "
                    "cluster beside it; set SLURM_CONF to its slurm.conf to run these tests on it")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root (slurm/local/up.sh): run as root, or set SLURM_CONF")
    folder = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, PATH=path, SLURM_LOCAL_NODES=str(NODES), SLURM_LOCAL_PORT=str(_free_ports(NODES + 1)))
    try:
        up = subprocess.run(["bash", ROOT / "slurm/local/up.sh", folder], capture_output=True, text=True,
                            timeout=120, env=env)
        assert up.returncode == 0, f"slurm/local/up.sh failed:\n{up.stdout}\n{up.stderr}"
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run(["bash", ROOT / "slurm/local/down.sh", folder], capture_output=True, timeout=120, env=env)


def slurm(cmd: list, slurm_env: dict) -> str:
    """A Slurm client command's output, asked of the test cluster."""
    return run(list(map(str, cmd)), env=slurm_env, timeout=60).stdout


def launcher(*args, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "launcher", *map(str, args)], timeout=300, check=check, env=env)


def merge_args(actor: Path, target: Path) -> list:
    return ["merge", "--local_dir", actor, "--target_dir", target]


def test_launcher_slurm_merges_with_a_task_on_each_of_two_nodes(slurm_env, fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint()
    logs = tmp_path / "logs"
    proc = launcher("slurm", "--nodes", 2, "--tasks-per-node", 1, "--cpu", "--folder", logs / "%j", "--",
                    *merge_args(actor, tmp_path / "out"), env=slurm_env)
    assert "COMPLETED" in proc.stdout
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    # The two tasks ran on different nodes (submitit logs where each started) and formed one group of two
    # merge ranks (rank 0 logs the plan).
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    job_dir = logs / job_id
    for task in (0, 1):
        assert f"node={task}(2), global_rank={task}(2)" in (job_dir / f"{job_id}_{task}_log.out").read_text()
    assert "2 merge ranks" in (job_dir / f"{job_id}_0_log.err").read_text()


def test_sbatch_template_merges_with_torchrun_on_two_nodes(slurm_env, fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint()
    log = tmp_path / "job.out"
    run(["sbatch", "--wait", "--nodes", "2", f"--export=ALL,NPROC_PER_NODE=1,PYTHON={sys.executable}",
         "--output", log, ROOT / "slurm/merge.sbatch", *merge_args(actor, tmp_path / "out"), "--device", "cpu"],
        timeout=300, env=slurm_env)
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


def test_launcher_slurm_reports_a_failed_merge(slurm_env, broken_checkpoint, tmp_path):
    broken, missing = broken_checkpoint
    proc = launcher("slurm", "--nodes", 2, "--cpu", "--folder", tmp_path / "logs" / "%j", "--",
                    *merge_args(broken, tmp_path / "out"), env=slurm_env, check=False)
    assert proc.returncode == os.EX_NOINPUT  # the merger's, passed on
    assert "FAILED" in proc.stdout
    assert "merger: error:" in proc.stderr and missing in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_launcher_stops_on_a_job_slurm_can_never_start(slurm_env, tmp_path):
    """More nodes than the cluster has: Slurm accepts the job and keeps it PENDING for a reason that never
    clears. The launcher shows the reason, cancels the job and fails within seconds."""
    nodes = len(set(slurm(["sinfo", "-h", "-N", "-o", "%N"], slurm_env).split()))
    started = time.monotonic()
    proc = launcher("slurm", "--nodes", nodes + 1, "--cpu", "--folder", tmp_path / "%j", "--",
                    *merge_args(tmp_path / "ckpt", tmp_path / "out"), env=slurm_env, check=False)
    assert time.monotonic() - started < 60
    assert proc.returncode == 1
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    reason = re.search(rf"job {job_id} PENDING \((Partition\w+)\)", proc.stdout).group(1)
    assert f"launcher: error: job {job_id} can never start, Slurm says {reason}" in proc.stderr, proc.stderr
    assert "cancelled it" in proc.stderr
    assert "JobState=CANCELLED" in slurm(["scontrol", "show", "job", "-o", job_id], slurm_env)


def test_launcher_fails_at_once_on_more_memory_than_a_node_has(slurm_env, tmp_path):
    """--mem beyond every node's RealMemory: sbatch refuses it, and the launcher says what Slurm said."""
    real_memory = max(map(int, slurm(["sinfo", "-h", "-N", "-o", "%m"], slurm_env).split()))
    started = time.monotonic()
    proc = launcher("slurm", "--mem", f"{2 * real_memory}M", "--cpu", "--folder", tmp_path / "%j", "--",
                    *merge_args(tmp_path / "ckpt", tmp_path / "out"), env=slurm_env, check=False)
    assert time.monotonic() - started < 60
    assert proc.returncode == 1 and "submitted job" not in proc.stdout
    assert "launcher: error: could not submit the Slurm job: Memory specification can not be satisfied" \
        in proc.stderr, proc.stderr


def test_launcher_local_merges_as_a_gloo_group(fsdp_checkpoint, tmp_path):
    """2 ranks merge the model's own weights, forked from the launcher once it imported torch: with
    PYTHONPROFILEIMPORTTIME, which makes every Python process report its imports, torch is imported once in all."""
    actor, reference = fsdp_checkpoint()
    proc = launcher("local", "--nproc", 2, "--", *merge_args(actor, tmp_path / "out"),
                    env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "2 merge ranks" in proc.stderr
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert len(re.findall(r"^import time:.*\|\s+torch$", proc.stderr, re.MULTILINE)) == 1


def test_launcher_local_fails_when_the_merge_fails(broken_checkpoint, tmp_path):
    broken, missing = broken_checkpoint
    proc = launcher("local", "--nproc", 2, "--", *merge_args(broken, tmp_path / "out"), check=False)
    assert proc.returncode == os.EX_NOINPUT  # the failing rank's
    assert "merger: error:" in proc.stderr and missing in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
