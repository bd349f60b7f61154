"""Shared fixtures: real checkpoints built once per session, and folders on other filesystems. The plumbing
they and the tests use (processes, in-process merges, output comparison) lives in tests/helpers."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.processes import run_writer
from tests.helpers.torchtitan_writes import written_by_torchtitan


# transformers binds FLA's Triton kernels (GPU only) in place of its torch Gated DeltaNet when it imports a model
# module while `import fla` works, so a Qwen3.5 forward on this CPU would fail or pass depending on which test
# imported the module first. The tests' process never imports FLA; torchtitan's writers, which need it, are
# processes of their own.
sys.modules["fla"] = None

# Tests send Ctrl-C (SIGINT) to the merger processes they start. A shell that starts the suite in the background
# (`make test &`, a CI step's `cmd &`) has it ignore SIGINT, and a child inherits an ignored signal, so merger would
# never see the Ctrl-C: Python's own handler makes the children start with SIGINT at its default again.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def other_filesystem(tmp_path):
    """A fresh folder in /dev/shm (tmpfs), on another filesystem than `tmp_path`; removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a writable /dev/shm on another filesystem than the test's temporary folder")
    folder = Path(tempfile.mkdtemp(prefix="merger-test-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory):
    """fsdp_checkpoint(arch, world, mesh=None, tied=False, ...) -> (actor_dir, reference_dir), built once each."""
    cache: dict = {}

    def make(arch: str = "llama", world: int = 4, mesh: str | None = None, tied: bool = False,
             extra: tuple = ()) -> tuple[Path, Path]:
        key = (arch, world, mesh, tied, extra)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"fsdp_{arch}_w{world}")
            actor = root / "global_step_1" / "actor"
            args = ["--out", actor, "--reference", root / "reference", "--arch", arch]
            args += (["--mesh", mesh] if mesh else []) + (["--tied"] if tied else []) + list(extra)
            run_writer("fsdp_checkpoint.py", *args, nproc=world)
            cache[key] = (actor, root / "reference")
        return cache[key]

    return make


@pytest.fixture(scope="session")
def dcp_written(tmp_path_factory) -> Path:
    """DCP checkpoints as torch writes them: FSDP2 over 4 ranks (plain/), HSDP 2x2 nested by accelerate with
    optimizer state (checkpoint-1/), torch tensor parallelism over 2 ranks (tp/checkpoint/)."""
    root = tmp_path_factory.mktemp("dcp_written")
    run_writer("dcp_checkpoint.py", "--out", root, "--hsdp", "2,2", nproc=4)
    run_writer("dcp_tp_checkpoint.py", "--out", root / "tp", nproc=2)
    return root


@pytest.fixture(scope="session")
def deepseek_v3_root(tmp_path_factory) -> Path:
    """A torchtitan DeepSeek-V3 checkpoint (MLA, MoE, a float32 expert bias), shared by the tests of several files."""
    return written_by_torchtitan(tmp_path_factory, "deepseek_v3")
