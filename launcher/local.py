"""A local gloo group without the torchrun binary: N ranks of `python -m merger` with the environment torchrun
would give them (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).

The ranks are forked from this process once it has imported merger's library, and with it torch
(merger.cli.load_library): each starts with them loaded instead of importing them again (1-2 s of CPU per rank on
a 2-core VM, which a second rank there pays on the core the first one streams on). Nothing has started a thread
by then (load_library keeps OpenBLAS to one), so the fork is safe; torch.distributed, gloo and CUDA all start in
the ranks.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback

from .rank_env import free_port, rank_vars
from .supervise import supervise


class ForkedRank:
    """A rank forked from this process, with what supervise uses of subprocess.Popen."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run_local(nproc: int, merger_args: list[str]) -> int:
    """Run the merger on `nproc` local ranks over gloo; return the first non-zero exit status, else 0."""
    if nproc < 1:
        print("launcher: error: --nproc must be at least 1", file=sys.stderr)
        return 2
    from merger.cli import command, load_library

    load_library()  # here, once: command() imports it only after parsing, which each rank would do after the fork
    port = free_port()
    args = [*merger_args, "--device", "cpu"]
    return supervise([_fork(command, args, rank_vars(r, nproc, "127.0.0.1", port, r, nproc)) for r in range(nproc)])


def _fork(command, args: list[str], variables: dict[str, str]) -> ForkedRank:
    """One rank: `command(args)` (which ends the process) in a child with the rank's environment."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written again by the child
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    try:
        # A session of its own: a Ctrl-C at the terminal reaches the launcher alone, which passes it on once.
        # Had it reached the ranks too, the SIGTERM that stops stragglers would land in their Ctrl-C cleanup
        # and be what they report.
        os.setsid()
        os.environ.update(variables)
        command(args)
    except BaseException:  # noqa: BLE001 - command ends the process itself; this is a failure before it could
        traceback.print_exc()
    finally:
        os._exit(1)
