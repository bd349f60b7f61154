"""Local files (and mounted buckets): preadv into the caller's buffer, one descriptor per file kept open.

pread rather than a memory mapping: a source file that shrinks while the merge runs (a trainer rewriting its
checkpoint) then gives a short read and one clear error, where touching a mapped page past the new end kills
the process with SIGBUS, which no handler turns into an error line.

The merge's source reads (`drop_cold`) do not fill the page cache with a checkpoint that was not there: a file
that was (almost) not cached when it was opened, as a checkpoint training wrote from other nodes or one the kernel
evicted since, has its pages dropped once a batch has read them, since a merge reads each byte once. A large
checkpoint then does not push out what the machine had cached (a training run's data, beside `merger watch`), and
on this project's VM, where a page-cache page is dear to fill anew, the cold 1-rank merge of a 16 GB checkpoint took
about half the time (docs/benchmarks.md). A file that was cached is left as it is, for the next reader.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import io
import mmap
import os
import stat
import sys

from .storage import Entry

# The C library, for the Linux calls `os` does not offer (fallocate's hole punching, sync_file_range); None elsewhere.
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None
if LIBC is not None:
    LIBC.mmap.restype = ctypes.c_void_p  # an address: the default int would cut it to 32 bits


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` with the bytes of the open file `fd` from `offset`, as far as the file goes; the bytes read."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


# A file is cold when at most COLD of its probed pages (one every PROBE_EVERY bytes) are cached: the catalog has
# read its index by then (a torch.save archive's pickle at its start and directory at its end).
PROBE_EVERY = 8 << 20
COLD = 0.1
# The page cache keeps a file's pages in folios of up to 2 MiB (a PMD on x86-64), and a drop takes whole folios
# only: the ranges read are joined where GAP or less lies between them (a zip record's header between two
# storages), then dropped aligned to that.
FOLIO = 2 << 20
GAP = 1 << 20


def cached_share(fd: int) -> float:
    """The share of the open file's probed pages that are in the page cache (mincore of a mapping, which faults
    nothing in). 1.0 where it cannot tell, so that the cache is left alone: not Linux, a file that cannot be
    mapped, and a file this process neither owns nor may write, whose cached pages mincore does not show (Linux 5.0
    and on)."""
    st = os.fstat(fd)
    shown = st.st_uid == os.geteuid() or os.access(f"/proc/self/fd/{fd}", os.W_OK)
    if LIBC is None or st.st_size == 0 or not shown:
        return 1.0
    mapped = LIBC.mmap(None, ctypes.c_size_t(st.st_size), mmap.PROT_READ, mmap.MAP_SHARED, fd, ctypes.c_long(0))
    if mapped in (None, ctypes.c_void_p(-1).value):
        return 1.0
    try:
        page, probes, cached = ctypes.c_ubyte(), range(0, st.st_size, PROBE_EVERY), 0
        for at in probes:
            if LIBC.mincore(ctypes.c_void_p(mapped + at), ctypes.c_size_t(1), ctypes.byref(page)) != 0:
                return 1.0
            cached += page.value & 1
        return cached / len(probes)
    finally:
        LIBC.munmap(ctypes.c_void_p(mapped), ctypes.c_size_t(st.st_size))


class LocalStorage:
    def __init__(self, drop_cold: bool = False):
        self.opened: dict[str, io.FileIO] = {}
        self.drop_cold = drop_cold
        # The descriptors of cold files (module docstring), each with the ranges read since the last drop_read
        self.cold: dict[int, list[tuple[int, int]]] = {}

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
        got = pread_into(self.local_fd(key), view, offset)
        self.was_read(key, offset, offset + got)
        return got

    def was_read(self, key: str, start: int, end: int) -> None:
        """Count bytes [start, end) of the file as read, here (read_into) or by the kernel for this process (a copy
        between files): a cold file's leave the page cache at the next drop_read."""
        ranges = self.cold.get(self.local_fd(key))
        if ranges is not None:
            ranges.append((start, end))

    def drop_read(self) -> None:
        """Drop from the page cache the whole folios of cold files read since the last call (a batch's)."""
        for fd, ranges in list(self.cold.items()):
            joined: list[list[int]] = []
            for start, end in sorted(ranges):
                if joined and start <= joined[-1][1] + GAP:
                    joined[-1][1] = max(joined[-1][1], end)
                else:
                    joined.append([start, end])
            ranges.clear()
            try:
                for start, end in joined:
                    start, end = -(-start // FOLIO) * FOLIO, end // FOLIO * FOLIO
                    if end > start:
                        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:  # advice the filesystem does not take: the file's pages stay, as any reader's would
                del self.cold[fd]

    def will_read(self, ranges: list[tuple[str, int, int]]) -> None:
        pass  # the kernel reads ahead in each file itself

    def local_fd(self, key: str) -> int:
        f = self.opened.get(key)
        if f is None:
            f = self.opened[key] = open(key, "rb", buffering=0)
            if self.drop_cold and cached_share(f.fileno()) <= COLD:
                self.cold[f.fileno()] = []
        return f.fileno()

    def close(self) -> None:
        for f in self.opened.values():
            f.close()
        self.opened.clear()
        self.cold.clear()


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
