"""A DCP `.metadata` with its chunks as arrays, not a Python object per chunk.

A 671B model saved by 64 FSDP2 ranks holds 2.9 M chunks, each a ChunkStorageMetadata in its tensor's `chunks`
and a MetadataIndex -> _StorageInfo entry of `storage_data`. dcp_metadata.load_compact reads the runs of them
straight into arrays (dcp_compact); the few the pickle holds otherwise (a record split by a frame, an odd
pickle) come as objects and join the arrays here. Chunks and storage entries are matched by (tensor, offsets)
in numpy rather than through a dict: the catalog holds the arrays, and makes a tensor's ShardPieces only when
they are asked for.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from ..catalog import PieceCopy, ShardPiece
from ..errors import CorruptSourceError, MergerError, SourceError
from ..hf_folder import named_file
from ..io import file_size
from .dcp_classes import TensorStorageMetadata
from .dcp_compact import CompactRecords, Rows
from .dcp_metadata import METADATA_FILE, load_compact


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
    metadata, records = load_compact(folder)
    try:
        return metadata, _tabled(metadata, records, folder)
    except (AttributeError, TypeError, ValueError) as e:  # a field of the wrong kind: a damaged pickle
        raise CorruptSourceError(f"damaged DCP metadata file ({type(e).__name__}: {e}), "
                                 f"{folder / METADATA_FILE}") from e


def _storage_of(chunks: list[np.ndarray], keys: list[np.ndarray], infos: np.ndarray) -> np.ndarray:
    """For each chunk (columns: tensor, ndim, offsets...), the storage entry whose key (the same columns) is the
    same, else -1: torch's (fqn, offset) equality of MetadataIndex. Later keys win, as in the dict torch builds."""
    where = np.full(len(chunks[0]), -1, dtype=np.int64)
    if not (len(keys[0]) and len(where)):
        return where
    codes = _packed(chunks, keys)
    if codes is None:
        return _storage_by_rows(chunks, keys, infos)
    chunk_code, key_code = codes
    order = np.argsort(key_code, kind="stable")  # equal keys keep their order: the last of a run is the latest
    key_code = key_code[order]
    at = np.searchsorted(key_code, chunk_code, side="right") - 1
    hit = at >= 0
    hit[hit] = key_code[at[hit]] == chunk_code[hit]
    where[hit] = infos[order[at[hit]]]
    return where


def _packed(chunks: list[np.ndarray], keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row of both tables as one int64, column bits side by side: equal rows, equal codes, and no other
    row the same code. At 2.9 M chunks one int a row is 23 MB; rows sorted as bytes take 10x that. None where the
    columns need more than 63 bits, or hold a negative value."""
    shift, bits = [], 0
    for c, k in zip(chunks, keys):
        low = min(int(c.min()), int(k.min()) if len(k) else 0)
        if low < 0:
            return None
        shift.append(bits)
        bits += max(int(c.max()), int(k.max()) if len(k) else 0).bit_length()
    if bits > 63:
        return None

    def code(columns: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(len(columns[0]), dtype=np.int64)
        for column, s in zip(columns, shift):
            out |= column.astype(np.int64) << s
        return out
    return code(chunks), code(keys)


def _storage_by_rows(chunks: list[np.ndarray], keys: list[np.ndarray], infos: np.ndarray) -> np.ndarray:
    """_storage_of for columns too wide to pack: each row as one opaque value (equal rows are equal bytes, and
    sorting those is 2x np.unique(axis=0))."""
    rows = np.ascontiguousarray(np.concatenate([np.column_stack(keys), np.column_stack(chunks)]), dtype=np.int64)
    _, inverse = np.unique(rows.view(np.dtype((np.void, 8 * rows.shape[1]))).ravel(), return_inverse=True)
    inverse = inverse.reshape(-1)
    entry = np.full(int(inverse.max()) + 1, -1, dtype=np.int64)
    entry[inverse[:len(keys[0])]] = infos
    return entry[inverse[len(keys[0]):]]


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


def _boxes(boxes: list) -> tuple[np.ndarray, np.ndarray]:
    """(ndim, padded ints) of boxes given as objects (torch.Size or tuples)."""
    ndim = np.fromiter(map(len, boxes), dtype=np.int64, count=len(boxes))
    return ndim, _padded(_flat(boxes, ndim), ndim, int(ndim.max(initial=0)))


def _widened(a: np.ndarray, width: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, max(0, width - a.shape[1]))))[:, :width]


def _in_order(items, records_rows: int) -> tuple[np.ndarray, list]:
    """Rows of (the compact records, then the objects among `items`) in the order of `items`, and those objects."""
    picks, objects = [], []
    for item in items:
        if isinstance(item, Rows):
            picks.append(np.arange(item.start, item.stop, dtype=np.int64))
        else:
            picks.append(np.array([records_rows + len(objects)], dtype=np.int64))
            objects.append(item)
    return (np.concatenate(picks) if picks else np.zeros(0, np.int64)), objects


def _tabled(metadata, records: CompactRecords, folder: Path) -> ChunkTable:
    tensors = [(f, m) for f, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    spans, start, order, picks = {}, 0, [], []  # order: chunks the pickle held as objects
    for fqn, meta in tensors:
        rows, objects = _in_order(meta.chunks, len(records.chunk_nd) + len(order))
        spans[fqn] = (start, start + len(rows))
        start += len(rows)
        order += objects
        picks.append(rows)
        meta.chunks = []  # the arrays say it all now
    picks = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    tensor_of = np.repeat(np.arange(len(tensors), dtype=np.int64), [b - a for a, b in spans.values()])
    extra_ndim, extra_offsets = _boxes([c.offsets for c in order])
    sizes_ndim, extra_sizes = _boxes([c.sizes for c in order])
    if not np.array_equal(extra_ndim, sizes_ndim):
        raise ValueError("a chunk's offsets and sizes differ in length")
    chunk_nd, chunk_offsets, chunk_sizes = records.take_chunks()  # one copy of each at a time, below
    ndim = np.concatenate([chunk_nd, extra_ndim])[picks]
    width = int(ndim.max(initial=0))
    offsets = np.concatenate([_widened(chunk_offsets, width), _widened(extra_offsets, width)])[picks]
    del chunk_offsets
    sizes = np.concatenate([_widened(chunk_sizes, width), _widened(extra_sizes, width)])[picks]
    del chunk_nd, chunk_sizes

    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    metadata.storage_data = None
    stored = records.take_storage()
    stored_rows = len(stored["fqn"])
    entries, objects = _in_order(storage, stored_rows)
    infos = [storage[k] for k in objects]
    index = {fqn: i for i, (fqn, _) in enumerate(tensors)}
    key_tensor = np.concatenate([np.asarray([index.get(f, -1) for f in records.strings], dtype=np.int64)[stored["fqn"]],
                                 np.fromiter((index.get(k.fqn, -1) for k in objects), np.int64, len(objects))])
    obj_ndim, obj_offsets = _boxes([k.offset or () for k in objects])
    key_ndim = np.concatenate([stored["nd"], obj_ndim])
    key_width = max(width, stored["key_offsets"].shape[1], obj_offsets.shape[1])
    key_offsets = np.concatenate([_widened(stored["key_offsets"], key_width), _widened(obj_offsets, key_width)])
    paths = sorted({records.strings[i] for i in np.unique(stored["path"]).tolist()}
                   | {info.relative_path for info in infos})
    for name in paths:
        named_file(folder, name, folder / METADATA_FILE)
    path_id = {p: i for i, p in enumerate(paths)}
    file = np.concatenate([np.asarray([path_id.get(p, -1) for p in records.strings], dtype=np.int64)[stored["path"]],
                           np.fromiter((path_id[i.relative_path] for i in infos), np.int64, len(infos))])
    byte_offset = np.concatenate([stored["byte_offset"], np.fromiter((int(i.offset) for i in infos), np.int64,
                                                                     len(infos))])
    length = np.concatenate([stored["length"], np.fromiter((int(i.length) for i in infos), np.int64, len(infos))])
    del stored
    key_tensor, key_ndim, key_offsets = key_tensor[entries], key_ndim[entries], key_offsets[entries]
    usable = (key_tensor >= 0) & (key_ndim <= width)  # a key of no tensor, or of more dims than any, matches none
    key_offsets = key_offsets[usable, :width]
    where = _storage_of([tensor_of, ndim, *offsets.T], [key_tensor[usable], key_ndim[usable], *key_offsets.T],
                        entries[usable])
    del key_tensor, key_ndim, key_offsets, usable, entries
    found, pick = where >= 0, np.maximum(where, 0)

    def column(values: np.ndarray) -> np.ndarray:
        return np.where(found, values[pick], -1) if len(values) else np.full(len(where), -1, np.int64)

    # newer torch's compression..., only ever on entries the pickle held as objects
    transformed = {stored_rows + j: info.transform_descriptors for j, info in enumerate(infos)
                   if info.transform_descriptors}
    transforms = {int(r): transformed[int(where[r])] for r in np.flatnonzero(np.isin(where, list(transformed)))} \
        if transformed else {}
    return ChunkTable(spans, offsets, sizes, column(file), column(byte_offset), column(length), transforms, paths)


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


def stored_ends(table: ChunkTable, rows: np.ndarray) -> dict[str, int]:
    """Where the storage of chunk `rows` ends, per file that holds any: its name beside `.metadata` -> the byte
    after the last chunk placed in it."""
    ends = np.zeros(len(table.paths), dtype=np.int64)
    np.maximum.at(ends, table.file[rows], table.byte_offset[rows] + table.length[rows])
    return {table.paths[i]: int(ends[i]) for i in np.unique(table.file[rows]).tolist()}


def check_end(ends: dict[str, int], file: str) -> None:
    """`file` holds every byte .metadata places in it (`ends`: stored_ends by full path); a stat, no read."""
    try:
        size = file_size(file)
    except FileNotFoundError as e:
        raise SourceError(f"DCP chunk file is missing, {file}") from e
    if size < ends.get(file, 0):
        raise CorruptSourceError(f"truncated: the DCP chunk file holds {size} bytes but .metadata places data up to "
                                 f"byte {ends[file]}, {file}")


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

    def one_copy_columns(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The pieces as arrays, for a planner that needs no object per piece (engine/plan.py): their sizes (a row
        of `ndim` each), and the index in the file list (the third item) of each one's only copy."""
        return self.table.sizes[self.rows, :self.ndim], self.table.file[self.rows], self.files

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
