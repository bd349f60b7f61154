"""DCP folders written with `FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)`.

Each `__{rank}_{k}.distcp` then holds its non-tensor entries (raw bytes) followed by one safetensors file of its
tensor chunks, keyed by DCP fqn, whose `__metadata__["DCP_SHARDING_INFO"]` is JSON {fqn: {"saved_offsets": [...]}}.
`.metadata` still gives every tensor's shape, dtype and chunks, but its byte ranges are only the start of that
safetensors part and the raw length (torch's own FileSystemReader cannot load such a folder). So the catalog
comes from `.metadata` as for any DCP folder, and this reader finds each chunk's bytes in the safetensors header
of its file: it reads the headers of the files its rank opened, checks every chunk placed there (dtype, shape,
saved offsets) and reads the exact range.
"""
from __future__ import annotations

import json
import struct

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import CorruptSourceError, MergerError, SourceError
from ..io import is_file, read_range
from ..safetensors_io import TensorEntry, read_header

SHARDING_INFO = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY
_ZIP_MAGIC = b"PK\x03\x04"  # a torch.save blob, DCP's default serialization


def holds_safetensors(tensors: dict[str, SourceTensor]) -> bool:
    """Whether the chunks are stored in safetensors form: the bytes where `.metadata` places the first chunk
    begin a safetensors header (a little-endian length, then a JSON object), not a torch.save zip."""
    copy = next((c for t in tensors.values() for p in t.pieces for c in p.copies), None)
    if copy is None:
        return False
    try:
        head = read_range(copy.file, copy.byte_range[0], 9)
    except OSError:
        return False  # the usual reader reports the missing or unreadable file
    if len(head) < 9 or head.startswith(_ZIP_MAGIC):
        return False
    return struct.unpack("<Q", head[:8])[0] > 0 and head[8:9] == b"{"


def saved_offsets(metadata: dict[str, str], file: str) -> dict[str, tuple[int, ...]]:
    try:
        info = json.loads(metadata[SHARDING_INFO])
        return {fqn: tuple(int(o) for o in v["saved_offsets"]) for fqn, v in info.items()}
    except KeyError as e:
        raise MergerError(f"safetensors part has no {SHARDING_INFO} metadata (not written by DCP?), {file}") from e
    except (ValueError, TypeError, AttributeError) as e:
        raise CorruptSourceError(f"safetensors part has malformed {SHARDING_INFO} metadata ({e}), {file}") from e


class DcpSafetensorsReader:
    """Finds each chunk in the safetensors header of its .distcp file, checked against `.metadata`."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.chunks_in: dict[str, list[tuple[SourceTensor, ShardPiece, PieceCopy]]] = {}
        for t in catalog.tensors.values():
            for piece in t.pieces:
                for c in piece.copies:
                    self.chunks_in.setdefault(c.file, []).append((t, piece, c))
        self.located: dict[str, tuple[int, dict[str, TensorEntry]]] = {}

    def _locate(self, file: str) -> tuple[int, dict[str, TensorEntry]]:
        """(data start, fqn -> entry) for one file, every chunk `.metadata` places there checked against it."""
        if file in self.located:
            return self.located[file]
        if not is_file(file):
            raise SourceError(f"DCP chunk file is missing, {file}")
        chunks = self.chunks_in.get(file, [])
        starts = {c.byte_range[0] for _, _, c in chunks}
        if len(starts) > 1:
            raise MergerError(f".metadata places this file's tensors at several offsets {sorted(starts)}, but a "
                              f"safetensors-format DCP file holds them in one safetensors part, {file}")
        data_start, entries, metadata = read_header(file, starts.pop() if starts else 0)
        saved = saved_offsets(metadata, file)
        for t, piece, c in chunks:
            entry = entries.get(c.key)
            if entry is None:
                raise MergerError(f"tensor {c.key} chunk at {piece.offsets}: .metadata places it in this file but its "
                                  f"safetensors header lacks it, {file}")
            if entry.dtype != t.dtype or entry.shape != piece.sizes:
                raise MergerError(f"tensor {c.key}: the file holds {entry.shape} {entry.dtype}, .metadata says "
                                  f"{piece.sizes} {t.dtype}, {file}")
            if saved.get(c.key) != piece.offsets:
                raise MergerError(f"tensor {c.key}: the file's chunk was saved at offsets {saved.get(c.key)}, "
                                  f".metadata places it at {piece.offsets}, {file}")
        self.located[file] = (data_start, entries)
        return self.located[file]

    def check_files(self, files: list[str]) -> None:
        for file in files:
            self._locate(file)

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        data_start, entries = self._locate(copy.file)
        entry = entries[copy.key]
        return Stored(copy.file, data_start + entry.begin, torch.empty(entry.shape, dtype=entry.dtype, device="meta"))
