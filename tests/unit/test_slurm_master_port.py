"""The store port a Slurm job's tasks agree on (launcher/slurm.py's master_port), without a cluster: rank 0's
choice is written into the job's folder and the other tasks read that one number.

Oracle: the operating system, which must let a listening socket bind the port rank 0 wrote. The whole path through
Slurm runs in tests/test_slurm.py.
"""
from __future__ import annotations

import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import slurm

pytestmark = pytest.mark.unit


def _task(folder: Path, rank: int) -> SimpleNamespace:
    """What master_port reads of submitit's JobEnvironment for one task of job 7."""
    return SimpleNamespace(paths=SimpleNamespace(folder=folder), job_id="7", global_rank=rank)


def test_every_task_gets_the_port_rank_0_found_free(tmp_path):
    got = {}
    waiting = threading.Thread(target=lambda: got.update(other=slurm.master_port(_task(tmp_path, 1))))
    waiting.start()  # a task that starts before rank 0 waits for its port
    got["rank0"] = slurm.master_port(_task(tmp_path, 0))
    waiting.join(timeout=10)
    assert got["other"] == got["rank0"]
    with socket.socket() as s:  # rank 0's store can listen there
        s.bind(("0.0.0.0", got["rank0"]))
        s.listen()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7_master_port"]


def test_a_task_whose_rank_0_never_says_its_port_fails_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "PORT_WAIT_S", 0.2)
    with pytest.raises(slurm.MergeFailed, match=r"rank 0 wrote no store port into .*7_master_port within 0.2 s"):
        slurm.master_port(_task(tmp_path, 1))
