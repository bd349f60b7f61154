"""Page-cache hints for writing, and the process's peak memory."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

from .dist import Group

_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range; no-op elsewhere).

    Only a hint: durability still comes from the fsync that closes each file.
    """
    if _libc is not None:
        _libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_per_rank(group: Group) -> list[int]:
    """Every rank's peak resident set size so far, in rank order, on every rank: a collective."""
    return group.all_gather(peak_rss_bytes())
