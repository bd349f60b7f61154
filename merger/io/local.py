"""Local files (and mounted buckets): preadv into the caller's buffer, one descriptor per file kept open.

pread rather than a memory mapping: a source file that shrinks while the merge runs (a trainer rewriting its
checkpoint) then gives a short read and one clear error, where touching a mapped page past the new end kills
the process with SIGBUS, which no handler turns into an error line.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import stat
import sys

from .storage import Entry

# The C library, for the Linux calls `os` does not offer (fallocate's hole punching, sync_file_range); None elsewhere.
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` with the bytes of the open file `fd` from `offset`, as far as the file goes; the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class LocalStorage:
    def __init__(self):
        self.opened: dict[str, io.FileIO] = {}

    def identity(self, key: str) -> dict[str, int | str]:
        # Size and mtime alone let wrong bytes through: a trainer overwriting its checkpoint keeps the size, and
        # `cp -p` keeps the mtime. The inode changes with a copy or a replace-by-rename, and the ctime with any
        # write, rename or utime call, and cannot be set back.
        st = os.stat(key)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}

    def size(self, key: str) -> int:
        return os.stat(key).st_size

    def list(self, key: str) -> list[Entry]:
        try:
            with os.scandir(key) as it:
                return sorted((Entry(e.name, e.is_dir()) for e in it), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def kind(self, key: str) -> str | None:
        try:
            mode = os.stat(key).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        return "dir" if stat.S_ISDIR(mode) else "file"

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        with open(key, "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [self.read(key, start, end - start) for start, end in ranges]

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        return pread_into(self.local_fd(key), view, offset)

    def will_read(self, ranges: list[tuple[str, int, int]]) -> None:
        pass  # the kernel reads ahead in each file itself

    def local_fd(self, key: str) -> int:
        f = self.opened.get(key)
        if f is None:
            f = self.opened[key] = open(key, "rb", buffering=0)
        return f.fileno()

    def close(self) -> None:
        for f in self.opened.values():
            f.close()
        self.opened.clear()


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


def preallocate(fd: int, length: int) -> bool:
    """Reserve the disk blocks of the first `length` bytes of the open file `fd`, as extents not yet written (they
    read as zeros, the size unchanged past them). False where the system or filesystem cannot (not Linux, or no
    fallocate); nothing is written either way, unlike posix_fallocate's fallback."""
    return LIBC is not None and LIBC.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(length)) == 0


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give back the disk blocks of bytes [offset, offset + length) of the open file `fd`, which then read as
    zeros; the file keeps its size. False where the system or filesystem cannot (not Linux, or no
    fallocate hole punching): the bytes then stay on disk until the file is removed."""
    return LIBC is not None and LIBC.fallocate(fd, _PUNCH_HOLE, ctypes.c_int64(offset), ctypes.c_int64(length)) == 0
