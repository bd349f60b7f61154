"""A local gloo group without the torchrun binary: N processes of `python -m merger` with the environment
torchrun would give them (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from .paths import python_path

# After one rank fails, the others normally fail too at the merger's next sync point; a rank that hangs
# instead (its peer died without a word) is stopped after this many seconds.
GRACE_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH"))
    return env


def run_local(nproc: int, merger_args: list[str]) -> int:
    """Run the merger on `nproc` local ranks over gloo; return the first non-zero exit status, else 0."""
    if nproc < 1:
        print("launcher: error: --nproc must be at least 1", file=sys.stderr)
        return 2
    port = _free_port()
    cmd = [sys.executable, "-m", "merger", *merger_args, "--device", "cpu"]
    # Each rank in a session of its own: a Ctrl-C at the terminal reaches the launcher alone, which passes it on
    # once. Had it reached the ranks too, the SIGTERM that stops stragglers would land in their Ctrl-C cleanup
    # and be what they report.
    procs = [subprocess.Popen(cmd, env=rank_env(r, nproc, port), start_new_session=True) for r in range(nproc)]
    status, failed_at = 0, None
    try:
        while [p for p in procs if p.poll() is None]:  # polls every rank, so each returncode is fresh
            codes = [p.returncode for p in procs if p.returncode]
            if codes and failed_at is None:
                status, failed_at = codes[0], time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        status = 130
        _pass_on_ctrl_c(procs)
    finally:
        for p in procs:  # only those still running: after a failure's grace period, or on Ctrl-C
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    return status or next((p.returncode for p in procs if p.returncode), 0)


def _pass_on_ctrl_c(procs: list[subprocess.Popen]) -> None:
    """SIGINT to every rank still running, then up to GRACE_S for them to clean up and say so; a second Ctrl-C
    stops the wait (the ranks still running are then terminated)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + GRACE_S
    with contextlib.suppress(KeyboardInterrupt):
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
