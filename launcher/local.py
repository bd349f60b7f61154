"""A local gloo group without the torchrun binary: N processes of `python -m merger` with the environment
torchrun would give them (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
from __future__ import annotations

import subprocess
import sys

from .rank_env import free_port, rank_env, rank_vars
from .supervise import supervise


def run_local(nproc: int, merger_args: list[str]) -> int:
    """Run the merger on `nproc` local ranks over gloo; return the first non-zero exit status, else 0."""
    if nproc < 1:
        print("launcher: error: --nproc must be at least 1", file=sys.stderr)
        return 2
    port = free_port()
    cmd = [sys.executable, "-m", "merger", *merger_args, "--device", "cpu"]
    # Each rank in a session of its own: a Ctrl-C at the terminal reaches the launcher alone, which passes it on
    # once. Had it reached the ranks too, the SIGTERM that stops stragglers would land in their Ctrl-C cleanup
    # and be what they report.
    return supervise([subprocess.Popen(cmd, env=rank_env(rank_vars(r, nproc, "127.0.0.1", port, r, nproc)),
                                       start_new_session=True) for r in range(nproc)])
