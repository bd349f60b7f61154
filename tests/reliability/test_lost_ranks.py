"""Failing, killed, silent and signalled ranks: one rank's error or loss stops every rank within seconds, with
one line naming the rank, and the staging folder is removed (or kept); ranks that finish leave quietly.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder (tests/reliability/conftest.py's `ckpt`) and damaged there as the case
needs. The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and
the processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import PAUSED_MERGER, rank_env, run_merger, start_ranks
from tests.helpers.reliability import (RANK0, RANK1, SMALL, WORLD, children, kill_rank_mid_merge, lost_line,
                                       start_merge, wait_all)
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow


def test_error_on_one_rank_stops_every_rank(ckpt, tmp_path):
    # Only merge rank 1 of 2 opens rank file 1; rank 0 must not wait for it forever.
    (ckpt / RANK1).write_bytes(os.urandom(4096))
    started = time.monotonic()
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", "--dist_timeout", "60",
                      nproc=2, check=False, timeout=120, torchrun=True)
    assert time.monotonic() - started < 90
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode != 0
    # One line (rank 0 prints it for the whole job), naming the failing rank and its file.
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("merger: error: rank 1: cannot load rank file") and errors[0].endswith(str(ckpt / RANK1))
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / ".out.merger-partial").exists()


def test_torchrun_report_names_the_error_as_root_cause(ckpt, tmp_path):
    """torchrun ends a failed job with its own report: it must show merger's line, read from the error record
    (TORCHELASTIC_ERROR_FILE) each failing rank wrote, not `error_file: <N/A>`."""
    (ckpt / RANK0).write_bytes(b"")
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", nproc=2, check=False,
                      torchrun=True)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    # torchrun's own exit status is 1 for any failed job; each rank's, the error's kind (corrupt: 65), is in its report
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "cannot load rank file: the file is empty" in errors[0] and errors[0].endswith(str(ckpt / RANK0))
    report = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(rf"exitcode\s*: {os.EX_DATAERR} \(pid", report), proc.stderr
    assert f"traceback : {errors[0]}" in report, proc.stderr
    assert "error_file: <N/A>" not in proc.stderr and "error_file: /" in report


# Within 15 s of the kill every rank has ended: one line names the lost rank, the staging folder is gone (or
# kept). Asleep, the survivors sit in Python (under torchrun its agent's SIGTERM reaches them; without it only
# the peer watch does); in a collective they sit in gloo's C++. Rank 0 hosts the store under plain env://;
# when it is lost, rank 1 keeps or removes the staging folder and prints the line, rank 2 stays silent.
LOST_RANK = {  # launch, lost rank, all ranks paused, --keep-partial, ranks
    "torchrun, peers in a collective": ("torchrun", 1, False, False, 2),
    "torchrun, peers asleep": ("torchrun", 1, True, False, 2),
    "torchrun, rank 0 lost, keep partial": ("torchrun", 0, False, True, 2),
    "env, peers in a collective": ("env", 1, False, False, 2),
    "env, peers asleep": ("env", 1, True, False, 2),
    "env, rank 0 lost, keep partial": ("env", 0, True, True, 3),
}


@pytest.mark.parametrize("case", list(LOST_RANK))
def test_killed_rank_ends_the_job_and_cleans_up(case, ckpt, tmp_path):
    launch, victim, pause_all, keep, nproc = LOST_RANK[case]
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    proc, took, killed = kill_rank_mid_merge(ckpt, out, tmp_path, *(["--keep-partial"] if keep else []),
                                              after_batch=3, pause_all=pause_all, launch=launch, victim=victim,
                                              nproc=nproc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert errors == [lost_line(victim, killed)], proc.stderr
    assert launch == "env" or "SIGKILL" in proc.stderr  # torchrun's root cause: the same rank
    assert not out.exists()
    assert stage.is_dir() == keep, proc.stderr
    assert not keep or (stage / "merge_manifest.json").is_file() and "kept the partial merge" in proc.stderr


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of merge rank `rank` among the processes started by `launcher` (torchrun, unshare) or itself."""
    for pid in [*children(launcher), launcher]:
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if f"RANK={rank}".encode() in env and (b"-m\0merger" in cmdline or bytes(PAUSED_MERGER) in cmdline):
                return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


@pytest.mark.parametrize("launch", ["torchrun", "env"])
def test_rank_killed_during_an_exchange(launch, fsdp_checkpoint, tmp_path):
    # No test hook: the merge runs freely. Once its staging folder exists, rank 1 is stopped: its peer goes on
    # into the next collective and waits there. Then rank 1 is killed.
    ckpt = fsdp_checkpoint("llama", WORLD, extra=("--layers", "6", "--hidden", "64"))[0]
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    args = ["merge", "--local_dir", ckpt, "--target_dir", out, *SMALL]
    procs = start_merge(launch, args, WORLD)
    deadline = time.monotonic() + 120
    while not stage.exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, wait_all(procs, args)
        time.sleep(0.01)
    victim = _rank_pid(procs[0].pid, 1) if launch == "torchrun" else procs[1].pid
    os.kill(victim, signal.SIGSTOP)
    time.sleep(1)
    assert all(p.poll() is None for p in procs) and stage.exists() and not out.exists()
    os.kill(victim, signal.SIGKILL)
    proc, took = wait_all(procs, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert errors == [lost_line(1, victim)], proc.stderr
    assert not out.exists() and not stage.exists()


def test_silent_rank_is_lost_by_its_heartbeat(ckpt, tmp_path):
    # Rank 1 runs in a pid namespace of its own, as if on another host: rank 0 cannot see its process, only
    # its heartbeats. Stopped (a frozen node: no socket closes, gloo waits for the full --dist_timeout), it
    # beats no more, and rank 0, stuck in a collective, ends within the staleness threshold.
    from merger.engine.peer_watch import PERIOD_S, STALE_BEATS

    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare needs CAP_SYS_ADMIN)")
    pause = tmp_path / "paused"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause), "MERGER_TEST_PAUSE_RANK": "1"}
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL, "--dist_timeout", "300"]
    procs = start_ranks(*args, nproc=WORLD, env=env, wrap={1: unshare})
    deadline = time.monotonic() + 120
    while not (Path(f"{pause}.1").exists() and Path(f"{pause}.1").read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, wait_all(procs, args)
        time.sleep(0.2)
    victim = _rank_pid(procs[1].pid, 1)
    os.kill(victim, signal.SIGSTOP)
    started = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        os.kill(victim, signal.SIGKILL)
        procs[1].communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("merger: error:")]
    assert errors == [f"merger: error: rank 1 was lost: no heartbeat from it on {socket.gethostname()} for "
                      f"{STALE_BEATS} beats of {PERIOD_S:g} s; every other rank stopped"], err
    assert procs[0].returncode == 1
    # The verdict needs STALE_BEATS missed beats, not less; then the end is quick (not the 300 s timeout).
    assert STALE_BEATS * PERIOD_S * 0.9 - PERIOD_S < took < STALE_BEATS * PERIOD_S + 15, took
    assert not (tmp_path / ".out.merger-partial").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("launch", ["torchrun", "env"])
def test_sigterm_reaches_a_rank_waiting_in_a_collective(launch, ckpt, tmp_path):
    # scancel, or torchrun stopped: every rank gets SIGTERM. Rank 1 sits in Python and handles it; rank 0 waits
    # in gloo's C++ for rank 1, where its Python handler cannot run. Both must end, clean up and say why.
    pause = tmp_path / "paused"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause), "MERGER_TEST_PAUSE_RANK": "1"}
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL]
    procs = start_merge(launch, args, WORLD, env)
    deadline = time.monotonic() + 120
    while not (Path(f"{pause}.1").exists() and Path(f"{pause}.1").read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, wait_all(procs, args)
        time.sleep(0.2)
    time.sleep(1)  # rank 0 is in the next collective by now
    for p in procs:
        p.send_signal(signal.SIGTERM)  # torchrun's agent passes it on to its workers
    proc, took = wait_all(procs, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert sorted(errors) == [f"merger: error: interrupted by SIGTERM (rank {r})" for r in range(WORLD)], proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()


def test_ranks_that_finish_leave_without_a_word(ckpt, reference, tmp_path):
    # Plain env:// ranks: rank 0's store goes away with it when it is done; no rank may take that for a loss.
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL]
    proc, _ = wait_all(start_ranks(*args, nproc=WORLD), args)
    assert proc.returncode == 0 and "merger: error" not in proc.stderr, proc.stderr
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


def test_a_store_port_another_process_holds_is_one_line_from_rank_0(ckpt, tmp_path):
    """Rank 0 of a plain env:// group hosts the store on MASTER_PORT: one that a stranger listens on already is said
    in one line, and nothing is written."""
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        port = stranger.getsockname()[1]
        proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", check=False,
                          env=rank_env(None, 0, WORLD, port))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [f"merger: error: rank 0 cannot host the group's store on port {port} of "
                                        f"127.0.0.1: another process holds that port (MASTER_PORT); start the ranks "
                                        f"again with a free one"]
    assert not (tmp_path / "out").exists()
