"""`merger inspect --check`: damaged and truncated source files found before a merge, one line per bad file.

Every case starts from a real checkpoint (a verl FSDP save by conftest's fsdp_checkpoint; a DCP save in
safetensors form in test_dcp_safetensors.py) copied into the test's folder and damaged there. The oracles are
torch.load (the bytes of the tensors' storages, which a clean check must have read, and where a tensor's bytes
lie, to flip one of them).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.files import flip_bit_in_tensor
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_merger, subprocess_env

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture
def actor(fsdp_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(fsdp_checkpoint("llama", WORLD)[0], tmp_path / "global_step_1" / "actor"))


def rank_file(actor: Path, rank: int) -> Path:
    return actor / f"model_world_size_{WORLD}_rank_{rank}.pt"


def truncate(file: Path, by: int = 5) -> None:
    os.truncate(file, file.stat().st_size - by)


def flip_a_bit(file: Path) -> None:
    state = torch.load(file, weights_only=False, map_location="cpu")
    tensor = next(v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 16)
    flip_bit_in_tensor(file, getattr(tensor, "_local_tensor", tensor))


def local_data_bytes(file: Path) -> int:
    """The bytes of the storages that the rank file's tensors (each DTensor's local shard) hold, as torch.load
    finds them."""
    state = torch.load(file, weights_only=False, map_location="cpu")
    storages = {}
    for value in state.values():
        storage = getattr(value, "_local_tensor", value).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def errors_of(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_intact_checkpoint_passes_having_read_every_data_record(actor, nproc):
    proc = run_merger("inspect", "--local_dir", actor, "--check", nproc=nproc)
    data = sum(local_data_bytes(rank_file(actor, rank)) for rank in range(WORLD))
    assert f"checked {WORLD} source files, {data} bytes (" in proc.stdout and "all fine" in proc.stdout, proc.stdout
    assert proc.stdout.count("all fine") == 1 and not errors_of(proc)


def test_a_truncated_rank_file_is_found_by_plain_inspect_too(actor):
    """Cut at its end, the file has lost its zip directory: plain inspect, which opens only rank 0's file, sees
    that from the file's end alone."""
    victim = rank_file(actor, 1)
    truncate(victim)
    for check in ([], ["--check"]):
        proc = run_merger("inspect", "--local_dir", actor, *check, check=False)
        assert proc.returncode == os.EX_DATAERR and "all fine" not in proc.stdout
        errors = errors_of(proc)
        assert len(errors) == 1 and "truncated: " in errors[0] and errors[0].endswith(str(victim)), proc.stderr


def test_a_flipped_bit_fails_its_checksum(actor):
    victim = rank_file(actor, 1)
    flip_a_bit(victim)
    proc = run_merger("inspect", "--local_dir", actor, "--check", check=False)
    assert proc.returncode == os.EX_DATAERR
    errors = errors_of(proc)
    assert len(errors) == 1 and "checksum mismatch in tensor" in errors[0] and errors[0].endswith(str(victim))


@pytest.mark.parametrize("nproc", [1, 2])
def test_each_bad_file_gets_its_own_line_on_any_number_of_ranks(actor, nproc):
    flip_a_bit(rank_file(actor, 0))
    truncate(rank_file(actor, 1))
    proc = run_merger("inspect", "--local_dir", actor, "--check", nproc=nproc, check=False)
    assert proc.returncode != 0
    errors = errors_of(proc)
    assert len(errors) == 2, proc.stderr
    assert "checksum mismatch" in errors[0] and errors[0].endswith(str(rank_file(actor, 0)))
    assert errors[1].endswith(str(rank_file(actor, 1)))


def test_a_reader_that_stops_reading_ends_inspect_quietly(actor):
    """`merger inspect --json | head`: the reader is gone before merger prints (its end of the pipe closed at
    once), and merger ends as `cat` would, with no error line."""
    proc = subprocess.Popen([sys.executable, "-m", "merger", "inspect", "--local_dir", str(actor), "--json"],
                            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0 and "error" not in stderr, stderr
