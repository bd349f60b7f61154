"""A torch.save file in a bucket seen as a local file, without fetching its tensors.

torch.save writes an uncompressed zip: a pickle (`data.pkl`) that describes the tensors, one record of raw bytes
per storage, and a directory at the end. torch.load(mmap=True), torch's own check for unsafe globals and
merger's zip-record reader read everything but the storages' bytes. Those parts are copied into a sparse local
file of the object's size, each at its own offset, the storages' data left as holes: the readers then find every
storage where it lies in the object, and the merge reads its bytes from the object itself, through its storage.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import BinaryIO

from .locations import is_remote, storage_of
from .range_file import RangeFile
from .scratch_folders import copying, scratch_folder

_HEADER = 30  # a zip local header's fixed part
_PADDING = 128  # torch pads a record's extra field so its data starts 64-byte aligned: kept whole with this
_SHADOWS: dict[str, str] = {}


def _kept_ranges(infos: list[zipfile.ZipInfo], size: int, directory_start: int) -> list[tuple[int, int]]:
    """(start, end) of every byte but the storages' data: headers, the pickle and small records, the directory."""
    records = sorted(infos, key=lambda i: i.header_offset)
    ranges = []
    for info, nxt in zip(records, [*(r.header_offset for r in records[1:]), directory_start]):
        end = nxt
        if "/data/" in info.filename:  # a storage: its local header and padding only
            end = min(nxt, info.header_offset + _HEADER + len(info.orig_filename.encode()) + _PADDING)
        ranges.append((info.header_offset, end))
    ranges.append((directory_start, size))
    return [(a, b) for a, b in ranges if b > a]


def zip_shadow(file: str) -> str:
    """`file` itself where it is local; for an object, a local file that holds its bytes but for the storages'
    data (fetched once per process, removed when it ends). A file that is no zip keeps its first 64 KiB, which
    tell what it is instead (a legacy torch file, an empty or damaged one)."""
    if not is_remote(file):
        return file
    if file not in _SHADOWS:
        storage, key = storage_of(file)
        size = storage.size(key)
        try:
            def read(view: memoryview, at: int) -> None:
                if storage.read_into(key, view, at) < len(view):
                    raise zipfile.BadZipFile("the object ends before its zip directory says")

            with zipfile.ZipFile(RangeFile(read, 0, size)) as archive:
                infos = archive.infolist()
                directory_start = archive.start_dir
            ranges = _kept_ranges(infos, size, directory_start)
        except zipfile.BadZipFile:
            ranges = [(0, min(size, 1 << 16))]
        shadow = str(scratch_folder("merger-shadow-") / Path(key).name)
        with copying(file, shadow), open(shadow, "wb") as f:
            f.truncate(size)
            for (start, _), data in zip(ranges, storage.read_ranges(key, ranges)):
                os.pwrite(f.fileno(), data, start)
        _SHADOWS[file] = shadow
    return _SHADOWS[file]


def open_shadow(file: str) -> BinaryIO:
    """`zip_shadow(file)` opened for reading: what a zip-record reader or a format sniff reads of `file`, wherever it
    lies."""
    return open(zip_shadow(file), "rb")
