"""merger processes started warm: forked from a process that has imported merger and torch already
(tests/helpers/warm_merger_server.py, one per test process), not exec'd anew.

Each is still a process of its own, with its own arguments, environment, folder, stdout and stderr, exit status
and signals: what the tests that start merger check. What it skips is the interpreter's start-up and `import
torch`, about 2 s of CPU for each rank of each merge, which made up a quarter of the suite's CPU. `launcher local`
starts its ranks the same way.

A start stays cold (a plain exec, processes.py) where the start-up is what a test looks at, or could differ:
- tests marked `interpreter` (their interpreter's start-up, site set-up and command line end to end);
- an environment that differs from the forker's in anything read while Python and torch start (only the variables
  of WARM_VARIABLES may differ: merger and the libraries it imports on its way read those once running);
- another entry point than `-m merger` (the wrapper scripts), a preexec_fn, a command prefix.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.helpers.hung import DUMP_WAIT_S, TimedOut, end_for_stacks
from tests.helpers.paths import ROOT

# Variables that may differ between the forker's environment and a child's: the process group's (read when the
# group starts), and those of libraries the forker has not imported (the S3, GCS, Azure and Hub clients read theirs
# when a merge first uses them), TMPDIR (the child forgets tempfile's cached folder), and the name of the current test.
WARM_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TMPDIR",
                  "PYTEST_CURRENT_TEST", "STORAGE_EMULATOR_HOST"}
WARM_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "HF_", "MERGER_")
MERGER_MAIN = str(ROOT / "merger" / "__main__.py")

# Set per test by tests/conftest.py: False for tests marked `interpreter`.
allowed = True


def _differs_warmly(key: str) -> bool:
    return key in WARM_VARIABLES or key.startswith(WARM_PREFIXES)


class Forker:
    """The client of one warm_merger_server: start(...) a child, wait(pid) for its exit status."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen([sys.executable, "-m", "tests.helpers.warm_merger_server", str(theirs.fileno())],
                                       cwd=ROOT, env=env, pass_fds=[theirs.fileno()], stdout=subprocess.DEVNULL)
        theirs.close()
        self.channel = ours
        self.lock = threading.Lock()
        self.replies = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> exit status
        self.next_id = 0  # also the number of children started
        self.ended = False  # the forker has closed its end
        threading.Thread(target=self._receive, daemon=True, name="warm-merger-replies").start()
        atexit.register(self.close)

    def close(self) -> None:
        """Ends the forker and waits for it, so that its CPU, and its children's, count as this process's."""
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        self.server.wait(timeout=30)

    def _receive(self) -> None:
        while message := self.channel.recv(1 << 16):
            reply = json.loads(message)
            with self.replies:
                if "id" in reply:
                    self.pids[reply["id"]] = reply["pid"]
                else:
                    self.codes[reply["pid"]] = reply["code"]
                self.replies.notify_all()
        with self.replies:
            self.ended = True
            self.replies.notify_all()

    def _reply(self, ready) -> None:
        """Wait until ready() under the replies' lock; if the forker ends first, say so rather than hang."""
        self.replies.wait_for(lambda: ready() or self.ended)
        if not ready():
            raise RuntimeError(f"the warm merger forker (pid {self.server.pid}) ended, exit status "
                               f"{self.server.wait()}; its stderr is the test's")

    def takes(self, env: dict[str, str]) -> bool:
        keys = env.keys() | self.env.keys()
        return self.server.poll() is None and all(env.get(k) == self.env.get(k) or _differs_warmly(k) for k in keys)

    def start(self, args: list[str], env: dict[str, str], cwd: Path, out: int, err: int) -> int:
        with self.lock:
            self.next_id += 1
            request = {"id": self.next_id, "args": args, "env": env, "cwd": str(cwd), "argv0": MERGER_MAIN}
            socket.send_fds(self.channel, [json.dumps(request).encode()], [out, err])
        with self.replies:
            self._reply(lambda: request["id"] in self.pids)
            return self.pids.pop(request["id"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status, or None if it has not exited within `timeout` seconds."""
        with self.replies:
            if not self.replies.wait_for(lambda: pid in self.codes or self.ended, timeout):
                return None
            self._reply(lambda: pid in self.codes)
            return self.codes.pop(pid)


_forkers: list[Forker] = []  # every forker this process started, the one in use last


def forker_for(env: dict[str, str]) -> Forker | None:
    """This process's forker, started on first use, if it can start a merger with `env`; else None.

    A forker is started anew when this process's own environment no longer matches the one it started with: a
    library imported by a test sets variables in it (compressed_tensors' import sets TORCHINDUCTOR_CACHE_DIR,
    ModelOpt's PYTORCH_NVML_BASED_CUDA_CHECK), and every later start would otherwise be cold. The old one is left to
    end with this process: its children may still run."""
    if not allowed:
        return None
    from tests.helpers.processes import subprocess_env

    own = subprocess_env()
    if not _forkers or not _forkers[-1].takes(own):
        _forkers.append(Forker(own))
    return _forkers[-1] if _forkers[-1].takes(env) else None


def started() -> int:
    """How many merger processes this process has started warm."""
    return sum(forker.next_id for forker in _forkers)


def _text(file) -> str:
    """What a child wrote, decoded as subprocess's text mode decodes a pipe (universal newlines)."""
    file.seek(0)
    return io.TextIOWrapper(io.BytesIO(file.read()), encoding=locale.getpreferredencoding(False)).read()


def run_group(forker: Forker, cmd: list, args: list[str], envs: list[dict[str, str]], cwd: Path,
              timeout: float | None) -> subprocess.CompletedProcess:
    """`merger ARGS` as one child per environment of `envs` (one, or the ranks of a group), waited for: their
    stdout and stderr in order, the first failure's exit status; past `timeout`, every child is killed and
    TimeoutExpired raised, as subprocess.run does."""
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in envs]
    try:
        pids = [forker.start(args, env, cwd, out.fileno(), err.fileno()) for env, (out, err) in zip(envs, files)]
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = [forker.wait(pid, None if deadline is None else max(0.0, deadline - time.monotonic())) for pid in pids]
        if None in codes:
            pending = [pid for pid, code in zip(pids, codes) if code is None]

            def running() -> bool:
                pending[:] = [pid for pid in pending if forker.wait(pid, DUMP_WAIT_S) is None]
                return bool(pending)

            end_for_stacks(pending, running)
            raise TimedOut(cmd, timeout, [_text(e) for _, e in files], "".join(_text(o) for o, _ in files))
        code = next((c for c in codes if c), 0)
        return subprocess.CompletedProcess(cmd, code, "".join(_text(o) for o, _ in files),
                                           "".join(_text(e) for _, e in files))
    finally:
        for out, err in files:
            out.close()
            err.close()
