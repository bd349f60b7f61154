"""What a Ray actor of `launcher.ray` does on its node: run one merge rank as a `python -m merger` process.

A process of its own, not `merger.cli.main` inside the actor, so that a rank fails the way it does under torchrun
or `launcher local`: it gets real signals (the launcher's Ctrl-C arrives as SIGINT, which the merger answers by
keeping its partial output and saying how to resume; Ray's worker would take a SIGINT as its own), its exit
status is the merger's, a rank killed by the kernel is seen as such by its peers while the actor lives on to
say so, and torch.distributed's state dies with the process instead of staying in a reused Ray worker. This
module imports no Ray: Ray gives the actor its GPUs through CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile

from .rank_env import free_port, rank_env

PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, where loading a library could deadlock on a lock another thread held.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _as_a_plain_process() -> None:
    """In the child before exec: SIGINT as a terminal gives it (Ray's worker blocks or ignores it, and both
    survive exec), and death with the actor, so a rank never outlives the actor that reports on it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RankProcess:
    """The actor's state: the merger process of its rank, and how much of its output the launcher has seen."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.outputs: list = []
        self.shown = [0, 0]

    def gpus(self) -> list[str]:
        """The GPUs Ray gave this actor, as this node's CUDA names them."""
        return [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, merger_args: list[str], variables: dict[str, str], cwd: str) -> None:
        # Output goes to files on this node, read back by `poll`: whole lines reach the launcher's own stdout
        # and stderr as the merger wrote them, with no prefix of Ray's in front of `merger: error:`.
        self.outputs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        # A session of its own, as under `launcher local`: only the launcher's signals reach it.
        self.proc = subprocess.Popen([sys.executable, "-m", "merger", *merger_args], env=rank_env(variables),
                                     cwd=cwd, stdout=self.outputs[0], stderr=self.outputs[1],
                                     start_new_session=True, preexec_fn=_as_a_plain_process)

    def poll(self) -> tuple[bytes, bytes, int | None]:
        """The stdout and stderr lines written since the last poll, and the exit status (None while running)."""
        code = self.proc.poll()  # before reading, so nothing written before the end is left unread
        new = []
        for i, file in enumerate(self.outputs):
            data = os.pread(file.fileno(), 1 << 20, self.shown[i])
            if code is None:  # whole lines only while it runs, so ranks' lines do not interleave mid-line
                data = data[:data.rfind(b"\n") + 1]
            self.shown[i] += len(data)
            new.append(data)
        return new[0], new[1], (None if code is None or any(new) else code)

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
