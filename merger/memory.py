"""Keep resident memory flat while reading memory-mapped checkpoint files, and page-cache hints for writing.

torch.load(mmap=True) maps a whole rank file; every page a read touches stays resident (and counts in RSS)
until the mapping goes away. After each batch the reader hands those ranges back to the kernel with
madvise(MADV_DONTNEED): the pages are clean copies of the file, so a later touch simply reads them again.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import resource
import sys

import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the whole pages under `tensor`'s bytes from this process's resident set (Linux; no-op elsewhere)."""
    if _libc is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _PAGE) * _PAGE  # only pages wholly inside the tensor: neighbours may still be in use
    last = end // _PAGE * _PAGE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range; no-op elsewhere).

    Only a hint: durability still comes from the fsync that closes each file.
    """
    if _libc is not None:
        _libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
