"""Files on disk: a snapshot to prove nothing was written, the disk space a folder takes (and a large one given
back early), which pages of a file the page cache holds, and damage done the way a test needs it (found by content
or rewritten with torch's own classes, never by merger's idea of the file)."""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import mmap
import os
import shutil
import subprocess
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every file under `folder` with its content hash, size and mtime: to prove nothing was written there."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(folder))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


def flip_bit_in_tensor(file: Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of `tensor`'s bytes where they lie in `file` (found by content: the oracle is the
    tensor torch.load returned, not merger's idea of the file's layout)."""
    data = bytearray(file.read_bytes())
    needle = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the tensor's bytes must occur once in the file"
    data[at + len(needle) // 2] ^= 0x04
    file.write_bytes(data)


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


def block_crc32(path: Path, block: int) -> list[str]:
    """zlib's CRC-32 of each `block` bytes of the file, the last piece shorter, as 8 hex digits: the manifest's
    oracle."""
    data = path.read_bytes()
    return [f"{zlib.crc32(data[start:start + block]):08x}" for start in range(0, len(data), block)]


def assert_same_files(a: Path, b: Path) -> None:
    """Two merges wrote the same files with the same bytes; their manifests differ only in where the source was
    or the output went."""
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        if name != "merge_manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def allocated(folder: Path) -> int:
    """The disk space the files below `folder` take (their allocated blocks: a punched range takes none)."""
    total = 0
    for root, _, names in os.walk(folder):  # a folder renamed or removed meanwhile is skipped
        for name in names:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@contextmanager
def removed_after(folder: Path):
    """`folder`, removed with what it holds when the block ends: for a module fixture's large files, which would
    otherwise take their disk space until the whole run ends (tmp_path_factory's folders live as long as the run)."""
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def peak_allocated(folder: Path):
    """Sample allocated(folder) every 20 ms while the block runs; yields a list whose one item becomes the peak."""
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], allocated(folder))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_pages(path: Path) -> list[bool]:
    """Per page (mmap.PAGESIZE) of `path`: whether the page cache holds it, as the kernel's mincore tells of a
    mapping of the file (mapping it reads nothing in)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            assert _LIBC.mincore(address, size, vec) == 0, ctypes.get_errno()
        finally:
            _LIBC.munmap(address, size)
    finally:
        os.close(fd)
    return [bool(v & 1) for v in vec]


def takes_o_direct(folder: Path) -> bool:
    """Whether the filesystem of `folder` takes an aligned O_DIRECT write (asked of the kernel, not of merger)."""
    buffer = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        return os.pwrite(fd, buffer, 0) == mmap.PAGESIZE
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(folder / "probe")


@contextmanager
def tmpfs(mnt: Path, options: str):
    """A fresh tmpfs mounted at `mnt` (created) with mount `options` ("size=64k", "ro,size=1m") for the block
    inside, unmounted after; the test is skipped where this process may not mount (not root)."""
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
