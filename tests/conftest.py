"""Shared test plumbing: run merger or a writer as real processes (one, or a torchrun gloo group), build real
checkpoints once per session, and compare outputs with an oracle that is not our code."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WRITERS = ROOT / "tests" / "writers"
sys.path.insert(0, str(WRITERS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    """The test environment plus `extra`; a PYTHONPATH given there goes in front of the test one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WRITERS), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    for key, value in (extra or {}).items():
        env[key] = value + os.pathsep + env[key] if key == "PYTHONPATH" else value
    return env


PAUSED_MERGER = ROOT / "tests" / "paused_merger.py"


@pytest.fixture
def other_filesystem(tmp_path):
    """A fresh folder in /dev/shm (tmpfs), on another filesystem than `tmp_path`; removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a writable /dev/shm on another filesystem than the test's temporary folder")
    folder = Path(tempfile.mkdtemp(prefix="merger-test-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


THREADS_AFTER_MERGE = ROOT / "tests" / "threads_after_merge.py"


def merger_entry(env: dict | None) -> list[str]:
    """How to start merger: `-m merger`, or the paused_merger.py script when the environment asks for a pause."""
    return [str(PAUSED_MERGER)] if env and "MERGER_TEST_PAUSE_AFTER_BATCH" in env else ["-m", "merger"]


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]


def run(cmd: list[str], timeout: float = 300, check: bool = True, env: dict | None = None,
        preexec_fn=None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_merger(*args, nproc: int = 1, check: bool = True, timeout: float = 300,
               env: dict | None = None, preexec_fn=None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m merger ARGS` as one process, or under torchrun with `nproc` gloo ranks, in folder `cwd`."""
    prefix = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return run(prefix + [*merger_entry(env), *map(str, args)], timeout=timeout, check=check, env=env,
               preexec_fn=preexec_fn, cwd=cwd)


def run_merger_leaving_no_thread(*args, nproc: int) -> subprocess.CompletedProcess:
    """Like run_merger under torchrun; then every rank must have returned from merger's main with only its main
    thread left, as the kernel lists the process's threads (tests/threads_after_merge.py)."""
    proc = run(torchrun_cmd(nproc) + [str(THREADS_AFTER_MERGE), *map(str, args)])
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == list(range(nproc)), proc.stdout
    for report in reports:
        assert report["after"] == report["before"] == ["python"], report
    return proc


def start_merger(*args, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
    """Like run_merger, but returns the running process (for tests that interrupt a merge)."""
    prefix = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return subprocess.Popen(prefix + [*merger_entry(env), *map(str, args)], cwd=ROOT, env=_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_ranks(*args, nproc: int, env: dict | None = None, wrap: dict | None = None,
                args_of_rank: dict | None = None) -> list[subprocess.Popen]:
    """`python -m merger ARGS` as the `nproc` ranks of a plain env:// gloo group, as Slurm tasks or
    `launcher local` start them: no torchrun agent, rank 0 hosts the store. `wrap` maps a rank to a command
    prefix (e.g. `unshare ...`), `args_of_rank` a rank to arguments of its own in place of ARGS."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        ranked = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                  "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        own = (args_of_rank or {}).get(rank, args)
        cmd = [*(wrap or {}).get(rank, []), sys.executable, *merger_entry(env), *map(str, own)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(ranked), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def run_writer(script: str, *args, nproc: int = 1) -> subprocess.CompletedProcess:
    prefix = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return run(prefix + [str(WRITERS / script), *map(str, args)])


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


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF folder, read by the safetensors library (not our reader)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_same_weights(merged: Path, reference: Path, dtype: torch.dtype | None) -> None:
    """The merge equals the model's own weights (save_pretrained's output) cast to `dtype`, bit for bit."""
    ours, ref = load_safetensors_folder(merged), load_safetensors_folder(reference)
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        want = want.to(dtype) if dtype is not None and want.is_floating_point() else want
        assert ours[name].dtype == want.dtype, name
        assert torch.equal(ours[name], want), name


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every file under `folder` with its content hash, size and mtime: to prove nothing was written there."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(folder))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


def merge_in_process(source: Path, target: Path, *extra) -> Path:
    """One merge in this process (the CLI's own entry point): no interpreter start-up per merge."""
    from merger.cli import main

    assert main(["merge", "--local_dir", str(source), "--target_dir", str(target), *map(str, extra)]) == 0
    return target


def merge_here(capsys, *args) -> tuple[int, list[str]]:
    """Run `merger merge ARGS` in this process; returns the exit code and the `merger: error:` lines."""
    from merger.cli import main

    code = main(["merge", *map(str, args)])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("merger: error:")]


def flip_bit_in_tensor(file: Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of `tensor`'s bytes where they lie in `file` (found by content: the oracle is the
    tensor torch.load returned, not merger's idea of the file's layout)."""
    data = bytearray(file.read_bytes())
    needle = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the tensor's bytes must occur once in the file"
    data[at + len(needle) // 2] ^= 0x04
    file.write_bytes(data)


def single_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def metadata_naming(folder: Path, old: str, new: str) -> None:
    """Rewrite a DCP folder's `.metadata` as torch pickles it (torch's reader and classes, not merger's), with the
    storage entries of file `old` naming `new` instead."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=new) if info.relative_path == old
                             else info for index, info in metadata.storage_data.items()}
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
