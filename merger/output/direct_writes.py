"""Output bytes written past the page cache (O_DIRECT), where the filesystem lies on this host.

A buffered write copies each byte into a page-cache page that the kernel must first find and account, and later
writes the page out again for the fsync that makes the model durable. On this project's 2-core VM filling new
page-cache pages cost 0.25-2.9 CPU s per GiB, depending on how much memory the host had to hand back to the guest
first, and the pwrites of a 1.87 GiB output took 1.6 s of a core: the largest single cost of a merge, and one
that ranks of a host pay one at a time (write_turns.py). The same GiB written with O_DIRECT from an aligned
buffer took 0.45-0.65 s of wall time, all of it the disk's, and 0.03 s of CPU, and two processes writing into
one file together went as fast as the disk.

O_DIRECT wants the file offset, the length and the memory address aligned to the device's logical block (512 B
or 4 KiB; ALIGN covers both). So each write is split: the aligned middle of a piece goes from a page-aligned
bounce buffer through a second, O_DIRECT descriptor of the same file, and its unaligned edges (a few KiB at
most; all of a piece shorter than a block) through the ordinary one. Linux keeps the two coherent: a direct
write flushes and drops cached pages of its range first, and edges never share a page with a direct range.

Only on the filesystems of write_turns.HOST_LOCAL: on NFS an O_DIRECT write is a synchronous round trip to the
server. Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE mounts) or an aligned write
(a device with larger blocks), the sink goes back to buffered writes for good, and nothing else changes.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

ALIGN = 4096
# Bytes per direct write: large enough that the disk streams (16 MiB writes ran at 1.6-2.4 GB/s here), small
# enough that the bounce buffer is no memory to speak of.
CHUNK = 8 << 20
# A piece shorter than this goes buffered whole: its aligned middle would be a direct write of a block or two.
SMALLEST = 64 << 10
# What O_DIRECT fails with where the filesystem or the device cannot take it (at open, or at the first write).
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


class DirectWrites:
    """Writes the aligned middles of pieces into output files with O_DIRECT, one descriptor per file, from a
    bounce buffer per writing thread. `available` turns False for good the first time the filesystem refuses."""

    def __init__(self, available: bool):
        self.available = available and hasattr(os, "O_DIRECT")  # Linux
        self.fds: dict[Path, int] = {}
        self.opening = threading.Lock()
        self.local = threading.local()

    def split(self, at: int, size: int) -> tuple[int, int] | None:
        """[start, end) of bytes [at, at + size) of a file to write directly (aligned), None for none."""
        if not self.available or size < SMALLEST:
            return None
        start, end = -(-at // ALIGN) * ALIGN, (at + size) // ALIGN * ALIGN
        return (start, end) if end > start else None

    def write(self, path: Path, data: memoryview, at: int) -> int:
        """Write `data` (aligned: split's range) at `at` of `path`; the bytes written, less than all of them only
        when the filesystem refused (the rest then goes buffered, as everything after it)."""
        done = 0
        try:
            fd = self._fd(path)
            bounce = self._bounce()
            while done < len(data):
                n = min(CHUNK, len(data) - done)
                bounce[:n] = data[done:done + n]
                written = os.pwrite(fd, bounce[:n], at + done)
                done += written
                if written % ALIGN:  # a short write left the rest unaligned: buffered from here on
                    break
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self.available = False
        return done

    def _fd(self, path: Path) -> int:
        with self.opening:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_WRONLY | os.O_DIRECT)
            return self.fds[path]

    def _bounce(self) -> memoryview:
        bounce = getattr(self.local, "bounce", None)
        if bounce is None:  # an anonymous mapping: page-aligned, as O_DIRECT needs the memory to be
            bounce = self.local.bounce = memoryview(mmap.mmap(-1, CHUNK))
        return bounce

    def close(self, path: Path) -> None:
        with self.opening:
            fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)
