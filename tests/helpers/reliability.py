"""What the failure-behaviour tests (tests/reliability/) share: the 2-rank checkpoint they damage, and merges
started under torchrun or as plain env:// ranks, a rank killed mid-merge, and every process waited for."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from tests.helpers.processes import start_merger, start_ranks, wait_ranks

WORLD = 2
RANK0, RANK1 = (f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD))
# Several output files and one step per batch, so a merge can be stopped between finished files.
SMALL = ["--max_shard_size", "20KB", "--max_inflight", "1"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_merge(launch: str, args: list, nproc: int, env: dict | None = None, wrap: dict | None = None
                ) -> list[subprocess.Popen]:
    """A merge under torchrun (one process: the agent), or as plain env:// ranks (one process each)."""
    if launch == "torchrun":
        return [start_merger(*args, nproc=nproc, env=env)]
    return start_ranks(*args, nproc=nproc, env=env, wrap=wrap)


def wait_all(procs: list[subprocess.Popen], args) -> tuple[subprocess.CompletedProcess, float]:
    """Wait for every process; their exit status (the first failure's) and stderr together, and the
    seconds until the last one ended."""
    started = time.monotonic()
    proc = wait_ranks(procs, args)
    return proc, time.monotonic() - started


def wait_paused(procs: list[subprocess.Popen], pause: Path, ranks) -> None:
    """Wait until each of `ranks` has paused after its batch (paused_merger.py wrote its pid into `pause`.RANK),
    failing if a process ends first or two minutes pass."""
    files = [Path(f"{pause}.{r}") for r in ranks]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.communicate() for p in procs]
        time.sleep(0.2)


def kill_rank_mid_merge(ckpt: Path, out: Path | str, tmp_path: Path, *extra, nproc: int = 2, victim: int = 1,
                        after_batch: int = 12, pause_all: bool = True, launch: str = "torchrun",
                        env: dict | None = None, before_kill: Callable[[], None] = lambda: None
                        ) -> tuple[subprocess.CompletedProcess, float, int]:
    """Start a real merge, let it pause after `after_batch` (test hook), SIGKILL one rank, wait for the end.
    Returns what the processes said, the seconds from the kill until every process ended, and the pid killed.

    With pause_all=False only the victim pauses: the other ranks are inside a collective when it dies. `extra`
    flags come after SMALL's, so they may replace them; `env` is added to the ranks' environment; `before_kill`
    runs once the ranks are paused (a check of what the merge has done so far).
    """
    pause = tmp_path / "paused"
    env = {**(env or {}), "MERGER_TEST_PAUSE_AFTER_BATCH": str(after_batch), "MERGER_TEST_PAUSE_FILE": str(pause)}
    if not pause_all:
        env["MERGER_TEST_PAUSE_RANK"] = str(victim)
    args = ["merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, *extra]
    procs = start_merge(launch, args, nproc, env)
    wait_paused(procs, pause, range(nproc) if pause_all else [victim])
    before_kill()
    workers = [w for p in procs for w in children(p.pid)]
    killed = int(Path(f"{pause}.{victim}").read_text())
    os.kill(killed, signal.SIGKILL)
    proc, took = wait_all(procs, args)
    assert not any(alive(p) for p in workers)
    return proc, took, killed


def children(pid: int) -> list[int]:
    """The worker processes torchrun started (or the merge process itself, without torchrun)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids] or [pid]


def lost_line(rank: int, pid: int) -> str:
    return (f"merger: error: rank {rank} was lost: its process (pid {pid} on {socket.gethostname()}) ended; "
            f"every other rank stopped")
