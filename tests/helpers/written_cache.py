"""The checkpoints the test writers write, kept once per clone in .test-cache/written/ (git-ignored, `make clean`
removes it) and copied from there to where a test asks for them: CI runs the whole suite under two interpreters in
one clone, and writing the checkpoints (with the oracle logits the writers save beside them) is most of its time.
MERGER_TEST_CACHE=0 writes every checkpoint afresh and leaves the cache alone.

An entry is keyed by what decides the bytes the writer writes: the writer module, its arguments (a path as which
output folder it lies in and where inside it), the environment given to it (a path there by its files' contents),
the number of ranks, the source of all of tests/writers/, and the writing interpreter's Python (major.minor) and
versions of the libraries that write. Python 3.11.0-3.11.4 pickle enum members by name, 3.11.5 and later by value:
writers that a test runs to check the pickles of the interpreter at hand (`per_interpreter`) key on sys.version too.

The writer writes into the test's own folders, as without the cache; the entry is then copied into a temporary
folder inside the cache and renamed into place, so an interrupted run never leaves an entry the next one trusts.
Tests get copies, never the entry's own files: a test that damages its checkpoint damages its copy.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

from tests.helpers.paths import ROOT, WRITERS

CACHE = ROOT / ".test-cache" / "written"
# What each writer run cost, a file per run (tests/helpers/timing_report.py adds up those of its own run).
WRITER_TIMES = ROOT / ".test-cache" / "times" / "writers"

# The distributions whose code runs in the writers (absent ones key as null).
LIBRARIES = ("torch", "megatron-core", "deepspeed", "torchtitan", "transformers", "peft", "accelerate", "safetensors",
             "tokenizers", "fla-core", "numpy", "einops", "triton", "nvidia-modelopt", "megatron-bridge")
_VERSIONS = """import importlib.metadata as m, json, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], **{name: version(name) for name in sys.argv[1:]}}))"""


def enabled() -> bool:
    return os.environ.get("MERGER_TEST_CACHE", "1") != "0"


@functools.cache
def _versions(python: str) -> dict:
    """The Python (major.minor) and the LIBRARIES' versions that `python` has (a writer venv may be another's)."""
    proc = subprocess.run([python, "-c", _VERSIONS, *LIBRARIES], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def _digest(path: Path) -> str:
    """sha256 of the relative names and contents of the files at `path` (one file or a folder), caches left out."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                   and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _writers_digest() -> str:
    return _digest(WRITERS)


def _env_part(value: str) -> str:
    """An environment value for the key: each existing path in it (PYTHONPATH's source trees) by its contents."""
    return os.pathsep.join(f"<{_digest(Path(p))}>" if p and os.path.isabs(p) and os.path.exists(p) else p
                           for p in value.split(os.pathsep))


def _output_folders(args: Sequence) -> list[Path] | None:
    """The folders the writer writes into: for each path argument, the nearest folder of it that exists (the
    test's fresh mktemp folder). None, so no caching, unless they are all empty folders (an argument that names
    something already there is an input, which the key does not capture)."""
    folders: list[Path] = []
    for arg in args:
        if isinstance(arg, Path):
            folder = next(p for p in (arg, *arg.parents) if p.exists())
            if folder not in folders:
                folders.append(folder)
    if not folders or not all(folder.is_dir() and not any(folder.iterdir()) for folder in folders):
        return None
    return folders


def _key(script: str, args: Sequence, folders: list[Path], nproc: int, env: dict | None, python: str,
         per_interpreter: bool) -> str:
    def arg_part(arg):
        if not isinstance(arg, Path):
            return str(arg)
        i, folder = next((i, f) for i, f in enumerate(folders) if arg == f or f in arg.parents)
        return ["out", i, str(arg.relative_to(folder))]

    material = {"writer": script, "args": [arg_part(a) for a in args], "nproc": nproc,
                "env": {k: _env_part(v) for k, v in sorted((env or {}).items())}, "versions": _versions(python),
                "writers": _writers_digest(), "interpreter": sys.version if per_interpreter else None}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def write_through_cache(script: str, args: Sequence, nproc: int, env: dict | None, python: str,
                        per_interpreter: bool, write: Callable[[], object]) -> None:
    """Run `write()` (the writer SCRIPT with ARGS) unless the cache holds its output; then copy that into place."""
    folders = _output_folders(args) if enabled() else None
    if folders is None:
        _timed(script, nproc, write)
        return
    entry = CACHE / _key(script, args, folders, nproc, env, python, per_interpreter)
    CACHE.mkdir(parents=True, exist_ok=True)
    # One writer per entry at a time: the suite's parallel workers (xdist) ask for the same checkpoints, and a
    # worker that asks second waits for the first one's entry instead of writing it again beside it.
    locks = CACHE.with_name(CACHE.name + ".locks")  # beside the cache, which holds entries and nothing else
    locks.mkdir(exist_ok=True)
    with open(locks / entry.name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir():
            for i, folder in enumerate(folders):
                shutil.copytree(entry / str(i), folder, symlinks=True, dirs_exist_ok=True)
            return
        _timed(script, nproc, write)
        _keep(entry, folders)


def _timed(script: str, nproc: int, write: Callable[[], object]) -> None:
    """write(), its wall time and the CPU time of the processes it ran (torchrun, its ranks) kept in WRITER_TIMES."""
    started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    write()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    WRITER_TIMES.mkdir(parents=True, exist_ok=True)
    (WRITER_TIMES / f"{uuid.uuid4().hex}.json").write_text(json.dumps({
        "writer": script, "nproc": nproc, "ended": time.time(), "wall_s": time.monotonic() - started,
        "cpu_s": used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime}))


def _keep(entry: Path, folders: list[Path]) -> None:
    """Copy what a writer wrote into `entry`, through a staging folder renamed into place."""
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=CACHE))
    try:
        for i, folder in enumerate(folders):
            shutil.copytree(folder, staging / str(i), symlinks=True)
        os.rename(staging, entry)  # fails if another run put the same entry there meanwhile: theirs stays
    except OSError:
        if not entry.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
