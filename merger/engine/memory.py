"""Page-cache hints for writing, and the process's peak memory."""
from __future__ import annotations

import ctypes
import resource

from ..io.local import LIBC
from .dist import Group

_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range; no-op elsewhere).

    Only a hint: durability still comes from the fsync that closes each file.
    """
    if LIBC is not None:
        LIBC.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)


def peak_rss_bytes() -> int:
    """This process's own peak resident set size so far: the kernel's VmHWM, the high-water mark of its address
    space, which starts anew at exec. Linux carries ru_maxrss across fork and exec, so a merge started by a 3 GiB
    trainer would report 3 GiB; it is the answer only where there is no /proc (KiB on Linux)."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_per_rank(group: Group) -> list[int]:
    """Every rank's peak resident set size so far, in rank order, on every rank: a collective."""
    return group.all_gather(peak_rss_bytes())
