"""State dicts loaded once per source file with torch.load(mmap=True), and where each tensor's bytes lie in it.

The load maps the file and builds tensors over the mapping without touching their pages. Merger reads none
of them through the mapping (file_reads.py says why): it takes their geometry and reads their bytes from the
file. torch.load maps the whole file once and makes each storage the slice at its zip record's data offset,
so all storages' data pointers are one base plus their records' offsets; the zip directory gives those
offsets, sizes and CRC-32s. Every storage is matched to a record of its size at that one base, or the file is
refused.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import replace
from typing import Callable, Iterator

import torch

from ..catalog import Stored, ZipRecord
from ..errors import CorruptSourceError
from ..io.zip_shadow import open_shadow
from .zip_records import ZipRecordError, open_archive, storage_record


def _tensors(state) -> Iterator[torch.Tensor]:
    """Every tensor in a loaded state (nested dicts, lists and tuples; a DTensor's local tensor)."""
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, torch.Tensor):
            yield getattr(value, "_local_tensor", value)


def _records(file: str) -> list[ZipRecord] | None:
    """The storage records of a torch.save file; None for a pre-zip file (torch < 1.6, loaded whole)."""
    try:
        with open_shadow(file) as f:  # a bucket's object: its local shadow holds all but the data
            archive, entries = open_archive(f)
            records = [storage_record(f, info) for name, info in entries.items() if name.startswith("data/")]
            size = os.fstat(f.fileno()).st_size
    except zipfile.BadZipFile:
        return None
    except (ZipRecordError, OSError, ValueError) as e:
        raise CorruptSourceError(f"cannot locate the tensors' bytes in the zip records ({e}), {file}") from e
    for r in records:
        if r.start + r.size > size:
            raise CorruptSourceError(f"zip record {r.name} runs past the end of the file (truncated?), {file}")
    return records


def _locate(file: str, state) -> dict[int, ZipRecord] | None:
    """Storage data pointer -> its record, with the span its tensors view; None for a file loaded whole."""
    records = _records(file)
    if records is None:
        return None
    spans: dict[int, list[int]] = {}  # data pointer -> [nbytes, first byte viewed, end of bytes viewed]
    for t in _tensors(state):
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size if t.numel() else lo
        span = spans.setdefault(storage.data_ptr(), [storage.nbytes(), lo, hi])
        span[1:] = [min(span[1], lo), max(span[2], hi)]
    if not spans:
        return {}
    by_start = {r.start: r for r in records}
    lowest = min(spans)
    for start in sorted(by_start):  # the lowest storage is normally the first record: one try
        base = lowest - start
        if all((r := by_start.get(ptr - base)) is not None and r.size == span[0] for ptr, span in spans.items()):
            return {ptr: replace(by_start[ptr - base], used=(span[1], span[2])) for ptr, span in spans.items()}
    raise CorruptSourceError(f"cannot match the tensors' storages to the file's zip records, {file}")


class MappedStates:
    """Each file's state (loaded on first use by `load`) and where its tensors' bytes lie."""

    def __init__(self, load: Callable[[str], dict]):
        self.load = load
        self.states: dict[str, dict] = {}
        self.records: dict[str, dict[int, ZipRecord] | None] = {}

    def __getitem__(self, file: str) -> dict:
        if file not in self.states:
            state = self.load(file)
            self.records[file] = _locate(file, state)
            self.states[file] = state
        return self.states[file]

    def stored(self, file: str, tensor: torch.Tensor) -> Stored:
        """Where `tensor` (from this file's state, or a view of one) lies in the file."""
        self[file]
        records = self.records[file]
        if records is None:
            return Stored(file, None, tensor)
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return Stored(file, 0, tensor)  # nothing to read
        record = records[storage.data_ptr()]
        return Stored(file, record.start, tensor, record)
