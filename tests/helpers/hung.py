"""What a process that ran past its test's timeout was doing, in the test's failure: every thread's Python stack,
written by the process itself into the stderr the test collects, before it is killed. A hang in CI is then a
stack in its log, not a bare "timed out after 300 seconds" that no rerun reproduces.

The processes the tests start have faulthandler on (PYTHONFAULTHANDLER, processes.subprocess_env), which dumps
every thread on SIGABRT and then lets the abort end the process."""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
from pathlib import Path
from typing import Callable

DUMP_WAIT_S = 5.0  # for a process to write its stacks and end on the abort, before it is killed
TAIL = 6000  # characters of each process's stderr that the failure shows: the stacks are at its end


def end_for_stacks(pids: list[int], running: Callable[[], bool]) -> bool:
    """End `pids` and every process they started (a torchrun agent's workers): SIGABRT first, so each dumps its
    stacks, then SIGKILL to those that `running()` (which waits up to DUMP_WAIT_S) still finds running. Whether
    every one ended."""
    every = [*pids, *(child for pid in pids for child in _descendants(pid))]
    for pid in every:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # the abort's default action leaves no core file
            os.kill(pid, signal.SIGABRT)
    if not running():
        return True
    for pid in every:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not running()


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, as the kernel lists them now."""
    try:
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:  # ended meanwhile
        return []
    return [*children, *(d for c in children for d in _descendants(c))]


class TimedOut(subprocess.TimeoutExpired):
    """TimeoutExpired whose message holds the end of each process's stderr: the stacks they dumped."""

    def __init__(self, cmd, timeout: float, errs: list[str], output: str | None = None):
        super().__init__(cmd, timeout, output, "".join(errs))
        self.errs = errs

    def __str__(self) -> str:
        tails = "".join(f"\n--- stderr of process {i} (last {TAIL} characters)\n{err[-TAIL:]}"
                        for i, err in enumerate(self.errs))
        return f"{super().__str__()}; each process's stacks at that moment:{tails}"
