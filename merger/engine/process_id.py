"""Which process this is, in a form another process can check: host, pid, kernel and start time.

A pid alone can be reused, and means nothing on another kernel or in another pid namespace: the start time
tells a reused pid apart, and the boot id plus pid namespace say when a pid can be looked up at all. The peer
watch (is a rank still running?) and the target lock (is the merge holding it still running?) both ask this.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessId:
    """Enough to tell, from another process, whether this one still runs."""
    host: str
    pid: int
    kernel: str  # boot id and pid namespace: pids mean the same to processes that share both
    start: str  # start time in clock ticks since boot: a reused pid has another one

    @classmethod
    def of_this_process(cls) -> ProcessId:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            kernel = f"{boot}:{os.readlink('/proc/self/ns/pid')}"
        except OSError:  # no procfs (not Linux): peers are judged by their heartbeats alone
            kernel = ""
        return cls(socket.gethostname(), os.getpid(), kernel, _start_time(os.getpid()) or "")

    def alive(self, here: ProcessId) -> bool | None:
        """Whether the process runs, when `here` can tell (same kernel and pid namespace), else None."""
        if not self.kernel or self.kernel != here.kernel:
            return None
        return _start_time(self.pid) == self.start


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat; None when the process is gone or a zombie (dead, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]
