"""Full and read-only disks: a target on a read-only or too small filesystem, a disk that fills up while the
merge writes, and a file size limit each end in one line and leave nothing that looks finished.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder (tests/reliability/conftest.py's `ckpt`) and damaged there as the case
needs. The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and
the processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import logging
import os
import resource
import signal
from pathlib import Path

import pytest

from tests.helpers.files import snapshot, tmpfs
from tests.helpers.in_process import merge_here
from tests.helpers.processes import run_merger

pytestmark = pytest.mark.slow


def _merge_into_tmpfs(capsys, tmp_path, mount_options: str, *args) -> tuple[int, list[str], Path, list[str]]:
    """Merge into `model` on a fresh tmpfs mounted with `mount_options`; returns the exit code, the error lines,
    the mount point and what the merge left there."""
    with tmpfs(tmp_path / "mnt", mount_options) as mnt:
        code, errors = merge_here(capsys, *args, "--target_dir", mnt / "model")
        return code, errors, mnt, sorted(p.name for p in mnt.iterdir())


def test_read_only_target(ckpt, tmp_path, capsys):
    # A read-only filesystem refuses even root, unlike file permissions.
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "ro,size=1m", "--local_dir", ckpt)
    assert code == os.EX_CANTCREAT and errors == [f"merger: error: target's parent folder is not writable, {mnt}"]
    assert left == []


@pytest.mark.parametrize("keep", [False, True])
def test_disk_full_while_writing(keep, ckpt, tmp_path, capsys, caplog):
    # 64 KiB holds the 54 KiB of weights (the free-space check passes) but not the config and tokenizer too.
    caplog.set_level(logging.INFO, logger="merger")
    source = snapshot(ckpt)
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "size=64k", "--local_dir", ckpt,
                                                *(["--keep-partial"] if keep else []))
    assert code == os.EX_CANTCREAT and len(errors) == 1 and "no space left on device" in errors[0].lower(), errors
    assert str(mnt / ".model.merger-partial") in errors[0]
    assert left == ([".model.merger-partial"] if keep else [])  # never a `model` folder
    assert ("kept the partial merge" in caplog.text) == keep
    assert snapshot(ckpt) == source


def test_not_enough_free_space_is_refused_up_front(ckpt, tmp_path, capsys):
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "size=16k", "--local_dir", ckpt)
    assert code == os.EX_CANTCREAT and len(errors) == 1 and "not enough free space" in errors[0], errors
    assert left == []


def _file_size_limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write returns EFBIG instead of killing the process


def test_file_size_limit(ckpt, tmp_path):
    source = snapshot(ckpt)
    out = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", out / "model", check=False,
                      preexec_fn=_file_size_limit)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode == os.EX_CANTCREAT and len(errors) == 1, proc.stderr
    assert "file too large" in errors[0].lower() and str(out / ".model.merger-partial") in errors[0]
    assert list(out.iterdir()) == []
    assert snapshot(ckpt) == source
