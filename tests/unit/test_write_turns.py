"""Ranks of one host take turns writing an output file (output/write_turns.py).

The filesystem type merger reads from /proc/self/mountinfo is checked against util-linux's findmnt, and the turn
against the kernel's flock: a write waits while another open file description holds the file's lock.
"""
import fcntl
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from merger.engine.plan import OutputFile, Runs
from merger.output.files import FileSink
from merger.output.safetensors_layout import file_layout
from merger.output.write_turns import HOST_LOCAL, filesystem_type, host_local, should_take_turns
from merger.safetensors_io import place_tensors

pytestmark = pytest.mark.unit


def _findmnt_type(path: Path) -> str:
    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="util-linux's findmnt is not installed on this machine")
def test_filesystem_type_agrees_with_findmnt(tmp_path):
    mountinfo = Path("/proc/self/mountinfo").read_text()
    for path in (tmp_path, Path("/proc/self"), Path("/dev"), Path("/sys"), Path("/")):
        path = path.resolve()
        assert filesystem_type(path, mountinfo) == _findmnt_type(path), path


def test_filesystem_type_takes_the_deepest_and_latest_mount():
    mountinfo = "\n".join([
        "20 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "30 20 0:40 / /scratch rw - lustre 10.0.0.1@tcp:/fs rw",
        r"31 20 0:41 / /data\040sets rw master:2 - nfs4 server:/export rw",
        "32 30 0:42 / /scratch/local rw - xfs /dev/nvme0n1 rw",
        "33 20 0:43 / /scratch rw - nfs server:/other rw",  # mounted over the lustre mount: it hides it
        "34 20 0:44 / /données rw - lustre 10.0.0.2@tcp:/fs rw",  # not escaped: only space, tab, newline, \\
    ])
    assert filesystem_type(Path("/home/user/model"), mountinfo) == "ext4"
    assert filesystem_type(Path("/data sets/run1"), mountinfo) == "nfs4"
    assert filesystem_type(Path("/scratch/local/out"), mountinfo) == "xfs"
    assert filesystem_type(Path("/scratch/out"), mountinfo) == "nfs"
    assert filesystem_type(Path("/scratchy"), mountinfo) == "ext4"
    assert filesystem_type(Path("/données/run1"), mountinfo) == "lustre"


def test_turns_only_for_several_ranks_on_a_host_local_filesystem(tmp_path):
    local = _findmnt_type(tmp_path.resolve()) in HOST_LOCAL
    assert host_local(tmp_path) is local
    assert should_take_turns(host_local(tmp_path), 2) is local
    assert should_take_turns(host_local(tmp_path), 8) is local
    assert should_take_turns(host_local(tmp_path), 1) is False


class _OneFile:
    """The least of a plan FileSink writes through: one file of 64 KiB with one tensor in it."""

    def __init__(self):
        (entry,) = place_tensors([("w", torch.uint8, (1 << 16,))])
        self.files = [OutputFile("model.safetensors", (entry,))]
        self.location = {"w": (0, entry)}


def test_a_turn_waits_for_the_host_lock(tmp_path):
    plan = _OneFile()
    header = file_layout(plan.files[0]).header
    (tmp_path / "model.safetensors").write_bytes(header + bytes(1 << 16))
    sink = FileSink(tmp_path, plan, take_turns=True)
    spec = SimpleNamespace(name="w")
    piece = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint8)
    holder = os.open(tmp_path / "model.safetensors", os.O_RDONLY)  # another open file: as another rank's
    fcntl.flock(holder, fcntl.LOCK_EX)
    writer = threading.Thread(target=sink.put_part, args=(spec, Runs(0, 1 << 16), piece))
    writer.start()
    time.sleep(0.5)
    assert writer.is_alive(), "the write went ahead while another rank held the turn"
    assert (tmp_path / "model.safetensors").read_bytes() == header + bytes(1 << 16)
    fcntl.flock(holder, fcntl.LOCK_UN)
    writer.join(10)
    os.close(holder)
    sink.close()
    assert not writer.is_alive()
    assert (tmp_path / "model.safetensors").read_bytes() == header + piece.numpy().tobytes()
