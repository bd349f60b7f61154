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
most; all of a piece shorter than SMALLEST) through the ordinary one. Linux keeps the two coherent: a direct
write flushes and drops cached pages of its range first, and edges never share a page with a direct range.

A piece that already lies in memory where a direct write can take it (its address and its file offset alike
modulo ALIGN: the stream lays out its batch buffers so, stream.AligningSink) and stays unchanged until `flush`
is written in place, with no bounce copy: 1.87 GiB of a merge's output then costs the CPU nothing but its
CRC, and a rank alone on its host writes past the page cache too. Where the ranks of a host take turns, the
rest goes through the bounce buffers (`bounce`); a rank alone writes it buffered, since the bounce copy costs
about what the page cache does when the VM fills pages fast.

A direct write returns once the disk has the bytes, so the writes run on a thread of their own (bounce buffers
two deep): the next chunk is copied or cast while the disk takes the last, as the kernel's writeback would
overlap them for a buffered write. `flush` waits for them all: at the end of each batch (its buffers are then
reused) and before a file is synced. A thread that needs only the bytes handed over so far in their files (the
checksum thread, before it records a block's CRC or reads a block back) takes a `mark` when it learns of them and
waits for it (`wait_written`): the writes are numbered as they are handed over and finish in that order, so the
wait ends once the writes up to the mark are done, however many are handed over meanwhile, where waiting for an
empty queue could last as long as the writer keeps it busy.

Only on the filesystems of write_turns.HOST_LOCAL: on NFS an O_DIRECT write is a synchronous round trip to the
server. Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE mounts) or an aligned write
(a device with larger blocks), at open or at the first write, the sink goes back to buffered writes for good.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

ALIGN = 4096
# Bytes per direct write: large enough that the disk streams (8-64 MiB writes all ran at 1.6-1.9 GB/s here),
# small enough that the bounce buffers are no memory to speak of.
CHUNK = 8 << 20
DEPTH = 2  # bounce buffers: one being filled while the other is written
# A piece shorter than this goes buffered whole: its aligned middle would be a direct write of a block or two.
SMALLEST = 64 << 10
# What O_DIRECT fails with where the filesystem or the device cannot take it (at open, or at the first write).
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


class DirectWrites:
    """Writes the aligned middles of pieces into output files with O_DIRECT, one descriptor per file, on a
    thread of its own. `available` turns False for good when the filesystem refuses; `bounce`: pieces that do not
    lie aligned in memory are copied into bounce buffers to go direct too (else the caller writes them buffered)."""

    def __init__(self, available: bool, bounce: bool = True):
        self.available = available and hasattr(os, "O_DIRECT")  # Linux
        self.bounce = bounce
        self.proven = False  # a first write went through: the filesystem takes them
        self.fds: dict[Path, int] = {}
        self.opening = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        # The bounce buffers not in flight, how many there are, the writes in flight and the first one that
        # failed: the sink's writer thread hands writes over, the write thread finishes them, and a checksum
        # thread may wait for them (flush).
        self.done = threading.Condition()
        self.free: list[memoryview] = []
        self.made = 0
        self.error: OSError | None = None
        # Writes handed to the thread are numbered 1, 2, ... (`handed`); its one thread does them in that order, so
        # `finished` is the last one done and every write before it is done too (`wait_written`).
        self.handed = 0
        self.finished = 0

    def split(self, at: int, size: int) -> tuple[int, int] | None:
        """[start, end) of bytes [at, at + size) of a file to write directly (aligned), None for none."""
        if not self.available or size < SMALLEST:
            return None
        start, end = -(-at // ALIGN) * ALIGN, (at + size) // ALIGN * ALIGN
        return (start, end) if end > start else None

    def write(self, path: Path, data: memoryview, at: int, seen: Callable[[memoryview, int], None] | None = None,
              lasting: bool = False) -> int:
        """Hand over `data` (aligned: split's range) to be written at `at` of `path`; the bytes handed over. Less
        than all of them when the filesystem refused (the rest then goes buffered, as everything after it), and
        none when `data` would need a bounce copy without `bounce`. `lasting`: `data` stays unchanged until flush,
        so where it lies aligned in memory it is written from where it is. `seen(chunk, offset)` is shown each
        chunk handed over, in order, while it is in the CPU's cache (from its bounce copy). An error of an
        earlier write is raised here or by flush."""
        in_place = lasting and _address(data) % ALIGN == 0
        if not (in_place or self.bounce):
            return 0
        try:
            fd = self._fd(path)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self.available = False
            return 0
        done = 0
        while done < len(data):
            n = min(CHUNK, len(data) - done)
            bounce = None if in_place else self._bounce()
            if bounce is None:
                chunk = data[done:done + n]
            else:
                chunk = bounce[:n]
                chunk[:] = data[done:done + n]
            if not self.proven:  # the first write waits: a filesystem may refuse it
                try:
                    _pwrite_all(fd, path, chunk, at + done)
                except OSError as e:
                    if e.errno not in _REFUSED:
                        raise
                    self.available = False
                    return done
                finally:
                    if bounce is not None:
                        with self.done:  # free again: only this thread waits for bounce buffers
                            self.free.append(bounce)
                self.proven = True
                if seen is not None:
                    seen(chunk, at + done)
            else:
                if seen is not None:  # while the chunk is in the cache from its copy
                    seen(chunk, at + done)
                with self.done:
                    self.handed += 1
                    number = self.handed
                    if self.pool is None:
                        self.pool = ThreadPoolExecutor(1, thread_name_prefix="merger-direct")
                self.pool.submit(self._write, fd, path, chunk, bounce, at + done, number)
            done += n
        return done

    def _write(self, fd: int, path: Path, chunk: memoryview, bounce: memoryview | None, at: int,
               number: int) -> None:
        error = None
        try:
            _pwrite_all(fd, path, chunk, at)
        except OSError as e:
            error = e
        with self.done:
            if bounce is not None:
                self.free.append(bounce)
            self.error = self.error or error
            self.finished = number
            self.done.notify_all()

    def _bounce(self) -> memoryview:
        """A free bounce buffer, waiting for a write to finish when every one is in flight."""
        with self.done:
            if not self.free and self.made < DEPTH:  # an anonymous mapping: page-aligned, as O_DIRECT needs
                self.made += 1
                return memoryview(mmap.mmap(-1, CHUNK))
            self.done.wait_for(lambda: self.free or self.error)
            if self.error is not None:
                raise self.error
            return self.free.pop()

    def mark(self) -> int:
        """Where the writes handed over so far end, for `wait_written`."""
        with self.done:
            return self.handed

    def wait_written(self, mark: int) -> None:
        """Wait until every write handed over before `mark` was taken is in its file (writes handed over since
        may still be in flight); raise the first write that failed."""
        with self.done:
            self.done.wait_for(lambda: self.finished >= mark)
            if self.error is not None:
                raise self.error

    def flush(self) -> None:
        """Wait for every write handed over; raise the first that failed."""
        with self.done:
            self.done.wait_for(lambda: self.finished == self.handed)
            if self.error is not None:
                raise self.error

    def _fd(self, path: Path) -> int:
        with self.opening:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_WRONLY | os.O_DIRECT)
            return self.fds[path]

    def close(self, path: Path) -> None:
        """After flush: close `path`'s descriptor."""
        with self.opening:
            fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        """After shutdown: close every descriptor still open."""
        for path in list(self.fds):
            self.close(path)

    def shutdown(self) -> None:
        """Wait for the writes in flight (their errors are flush's to report) and end the write thread."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _address(data: memoryview) -> int:
    """Where `data`'s first byte lies in memory (a writable buffer: merger's own)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


def _pwrite_all(fd: int, path: Path, data: memoryview, at: int) -> None:
    """Write all of `data` at `at`; an error names `path` (raised on another thread, it is reported later)."""
    done = 0
    while done < len(data):
        try:
            written = os.pwrite(fd, data[done:], at + done)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from e
        done += written
        if done < len(data) and (written == 0 or written % ALIGN):  # the rest would be unaligned
            raise OSError(errno.EIO, f"a direct write stopped short at byte {at + done}", str(path))
