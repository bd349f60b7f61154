"""A DCP `.metadata` with its chunks as arrays, not a Python object per chunk.

A 671B model saved by 64 FSDP2 ranks holds 2.9 M chunks. As dcp_metadata loads it, each chunk is a
ChunkStorageMetadata with two torch.Size, plus a MetadataIndex and a _StorageInfo in `storage_data`. Right after
the (restricted) load, their fields go into arrays, chunks and storage entries are matched by (tensor, offsets)
in numpy rather than through a dict, and the objects are dropped: the catalog holds the arrays, and makes a
tensor's ShardPieces only when they are asked for.

Why not arrays while unpickling: CPython's unpickler keeps every object it made (its memo) until the load ends,
so the peak is the same either way, and a Python __setstate__ per object doubled the load's time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from ..catalog import PieceCopy, ShardPiece
from ..errors import MergerError
from ..hf_folder import named_file
from .dcp_classes import TensorStorageMetadata
from .dcp_metadata import METADATA_FILE, load_metadata


@dataclass(frozen=True)
class ChunkTable:
    """Every tensor's chunks, in `.metadata`'s order, with where each is stored.

    Tensor `fqn`'s chunks are rows `spans[fqn]` (start, stop) of the arrays; `offsets`/`sizes` have one column
    per dim of that tensor (the rest 0); `file` indexes `paths` (names beside `.metadata`), -1: no storage entry;
    `transforms`: the storage transforms (compression...) of the chunks saved with any, by row."""

    spans: dict[str, tuple[int, int]]
    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    length: np.ndarray
    transforms: dict[int, list]
    paths: list[str]


def load_chunk_table(folder: Path):
    """`.metadata` as (Metadata with each tensor's `chunks` emptied and no `storage_data`, ChunkTable)."""
    metadata = load_metadata(folder)
    try:
        return metadata, _tabled(metadata, folder)
    except (AttributeError, TypeError, ValueError) as e:  # a field of the wrong kind: a damaged pickle
        raise MergerError(f"damaged DCP metadata file ({type(e).__name__}: {e}), {folder / METADATA_FILE}") from e


def _storage_of(chunks: np.ndarray, keys: np.ndarray, infos: np.ndarray) -> np.ndarray:
    """For each chunk row (tensor, ndim, offsets...), the storage entry whose key row is the same, else -1: torch's
    (fqn, offset) equality of MetadataIndex. Later keys win, as in the dict torch builds."""
    where = np.full(len(chunks), -1, dtype=np.int64)
    if len(keys) and len(chunks):
        _, inverse = np.unique(np.concatenate([keys, chunks]), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        entry = np.full(int(inverse.max()) + 1, -1, dtype=np.int64)
        entry[inverse[:len(keys)]] = infos
        where = entry[inverse[len(keys):]]
    return where


def _flat(boxes: list, ndim: np.ndarray) -> np.ndarray:
    """Every box's ints (offsets or sizes) end to end."""
    return np.fromiter(chain.from_iterable(boxes), dtype=np.int64, count=int(ndim.sum()))


def _padded(flat: np.ndarray, ndim: np.ndarray, width: int) -> np.ndarray:
    """One row of `width` columns per box: its `ndim` ints from `flat`, then zeros."""
    at = np.concatenate([[0], np.cumsum(ndim)[:-1]]).astype(np.int64) if len(ndim) else ndim
    out = np.zeros((len(ndim), width), dtype=np.int64)
    for d in range(width):
        has = ndim > d
        out[has, d] = flat[at[has] + d]
    return out


def _tabled(metadata, folder: Path) -> ChunkTable:
    tensors = [(f, m) for f, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    chunks = [c for _, m in tensors for c in m.chunks]
    spans, start = {}, 0
    for fqn, meta in tensors:
        spans[fqn] = (start, start + len(meta.chunks))
        start += len(meta.chunks)
        meta.chunks = []  # the arrays say it all now
    tensor_of = np.repeat(np.arange(len(tensors), dtype=np.int64), [b - a for a, b in spans.values()])
    offsets = [c.offsets for c in chunks]
    sizes = [c.sizes for c in chunks]
    del chunks
    ndim = np.fromiter(map(len, offsets), dtype=np.int64, count=len(offsets))
    if not np.array_equal(ndim, np.fromiter(map(len, sizes), dtype=np.int64, count=len(sizes))):
        raise ValueError("a chunk's offsets and sizes differ in length")
    width = int(ndim.max(initial=0))
    offsets, sizes = _padded(_flat(offsets, ndim), ndim, width), _padded(_flat(sizes, ndim), ndim, width)

    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    metadata.storage_data = None
    index = {fqn: i for i, (fqn, _) in enumerate(tensors)}
    key_tensor = np.fromiter((index.get(k.fqn, -1) for k in storage), dtype=np.int64, count=len(storage))
    key_boxes = [k.offset or () for k in storage]
    key_ndim = np.fromiter(map(len, key_boxes), dtype=np.int64, count=len(key_boxes))
    key_offsets = _padded(_flat(key_boxes, key_ndim), key_ndim, max(width, int(key_ndim.max(initial=0))))
    infos = list(storage.values())
    del storage, key_boxes
    usable = (key_tensor >= 0) & (key_ndim <= width)  # a key of no tensor, or of more dims than any, matches none
    where = _storage_of(np.column_stack([tensor_of, ndim, offsets]),
                        np.column_stack([key_tensor[usable], key_ndim[usable], key_offsets[usable, :width]]),
                        np.flatnonzero(usable))
    paths = sorted({info.relative_path for info in infos})
    for name in paths:
        named_file(folder, name, folder / METADATA_FILE)
    path_id = {p: i for i, p in enumerate(paths)}
    found, pick = where >= 0, np.maximum(where, 0)

    def column(values) -> np.ndarray:
        values = np.fromiter(values, dtype=np.int64, count=len(infos))
        return np.where(found, values[pick], -1) if len(values) else np.full(len(where), -1, np.int64)

    transformed = [j for j, info in enumerate(infos) if info.transform_descriptors]  # newer torch's compression...
    transforms = {int(r): infos[int(where[r])].transform_descriptors
                  for r in np.flatnonzero(np.isin(where, transformed))} if transformed else {}
    return ChunkTable(spans, offsets, sizes, column(path_id[i.relative_path] for i in infos),
                      column(int(i.offset) for i in infos), column(int(i.length) for i in infos), transforms, paths)


def check_stored(table: ChunkTable, fqn: str, rows: np.ndarray, ndim: int, folder: Path) -> None:
    """MergerError for the first of tensor `fqn`'s chunk `rows` that has no storage entry, or was stored with
    transforms (compression...) merger cannot undo."""
    bad = rows[(table.file[rows] < 0) | np.isin(rows, list(table.transforms))]
    if not len(bad):
        return
    row = int(bad[0])
    if table.file[row] < 0:
        offsets = tuple(table.offsets[row, :ndim].tolist())
        raise MergerError(f"tensor {fqn} chunk at {offsets} has no storage entry, {folder / METADATA_FILE}")
    raise MergerError(f"tensor {fqn} was saved with storage transforms {list(table.transforms[row])} "
                      f"(e.g. compression), which merger cannot read, {folder / METADATA_FILE}")


def chunk_rows(table: ChunkTable, rows: np.ndarray, ndim: int):
    """(offsets, sizes, file index, (byte offset, length)) of each of `rows`, as Python ints."""
    return zip(map(tuple, table.offsets[rows, :ndim].tolist()), map(tuple, table.sizes[rows, :ndim].tolist()),
               table.file[rows].tolist(), zip(table.byte_offset[rows].tolist(), table.length[rows].tolist()))


class TablePieces(Sequence):
    """One tensor's pieces, made from the table when asked for: rows `rows` (one DCP chunk each) of `table`,
    read from `files[table.file[row]]` by the key `fqn`. Equal to the tuple of the same ShardPieces."""

    __slots__ = ("table", "rows", "ndim", "fqn", "files")

    def __init__(self, table: ChunkTable, rows: np.ndarray, ndim: int, fqn: str, files: list[str]):
        self.table, self.rows, self.ndim, self.fqn, self.files = table, rows, ndim, fqn, files

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return self._made(self.rows)

    def _made(self, rows: np.ndarray):
        for offsets, sizes, file, byte_range in chunk_rows(self.table, rows, self.ndim):
            yield ShardPiece(offsets, sizes, (PieceCopy(self.files[file], self.fqn, byte_range),))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._made(self.rows[i]))
        return next(self._made(self.rows[[i]]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))
