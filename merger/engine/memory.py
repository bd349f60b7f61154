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
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_per_rank(group: Group) -> list[int]:
    """Every rank's peak resident set size so far, in rank order, on every rank: a collective."""
    return group.all_gather(peak_rss_bytes())
