"""Several catalogs read as one (a base model and its adapters): names get a per-part prefix, and each file is
read by the reader of the part it came from."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored


def union_catalog(parts: dict[str, Catalog], root: Path, fmt: str) -> Catalog:
    """`parts` maps a prefix to a catalog; tensor `n` of part `p` becomes `p + n`. Files keep their order."""
    tensors: dict[str, SourceTensor] = {}
    for prefix, c in parts.items():
        for name, t in c.tensors.items():
            tensors[prefix + name] = SourceTensor(prefix + name, t.shape, t.dtype, t.pieces)
    files = [f for c in parts.values() for f in c.files]
    checks = {f: c.check_file for c in parts.values() if c.check_file for f in c.files}
    return Catalog(format=fmt, root=root, tensors=tensors, files=files,
                   reader_factory=partial(UnionReader, list(parts.values())),
                   check_file=lambda f: checks[f](f) if f in checks else None,
                   details={f"{p or 'base'} files": len(c.files) for p, c in parts.items()})


class UnionReader:
    def __init__(self, parts: list[Catalog], catalog: Catalog):
        self.readers = [c.open_reader() for c in parts]
        self.reader_of = {f: r for c, r in zip(parts, self.readers) for f in c.files}

    def check_files(self, files: list[str]) -> None:
        for reader in self.readers:
            reader.check_files([f for f in files if self.reader_of[f] is reader])

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        return self.reader_of[copy.file].locate(copy, piece, dtype)
