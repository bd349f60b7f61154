"""A catalog with stacked tensors split along their first axis: [E, ...] becomes E tensors of shape [...].

torchtitan keeps a MoE layer's routed experts as one tensor per projection ([E, F, D]); transformers writes one
tensor per expert. Each expert's part of a stored piece is a selection along the piece's first axis, a
contiguous run of its bytes, so it is read straight from the same file by the same reader (narrowed: the
record's checksum still covers every byte read) and no rank ever holds the stacked tensor whole.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError
from .piece_keys import split_key, take, with_index


def unstacked(catalog: Catalog, parts: dict[str, Callable[[int], str]]) -> Catalog:
    """`catalog` with each tensor named in `parts` split along axis 0; part e of tensor n is named parts[n](e)."""
    tensors: dict[str, SourceTensor] = {}
    whole: dict[tuple[str, str], ShardPiece] = {}  # (file, part's key) -> the stored piece it is taken from
    for name, t in catalog.tensors.items():
        if name not in parts:
            tensors[name] = t
            continue
        if len(t.shape) < 2:
            raise MergerError(f"tensor {name} is {t.shape}, not a stack of experts, {catalog.root}")
        split: dict[int, list[ShardPiece]] = {e: [] for e in range(t.shape[0])}
        for piece in t.pieces:
            for local in range(piece.sizes[0]):
                copies = tuple(dataclasses.replace(c, key=with_index(c.key, (local,))) for c in piece.copies)
                whole.update({(c.file, c.key): piece for c in copies})
                split[piece.offsets[0] + local].append(ShardPiece(piece.offsets[1:], piece.sizes[1:], copies))
        for e, pieces in split.items():
            tensors[parts[name](e)] = SourceTensor(parts[name](e), t.shape[1:], t.dtype, tuple(pieces))
    return dataclasses.replace(catalog, tensors=tensors,
                               reader_factory=partial(UnstackedReader, catalog, whole))


class UnstackedReader:
    """The catalog's own reader, asked for the stored piece and narrowed to the part."""

    def __init__(self, stacked: Catalog, whole: dict[tuple[str, str], ShardPiece], catalog: Catalog):
        self.inner, self.whole = stacked.open_reader(), whole
        # Each stored piece located once, not once per expert (a DCP chunk's blob directory is read to locate
        # it): geometry only, no data.
        self.located: dict[tuple[str, str], Stored] = {}

    def check_files(self, files: list[str]) -> None:
        self.inner.check_files(files)

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        stacked = self.whole.get((copy.file, copy.key))
        if stacked is None:
            return self.inner.locate(copy, piece, dtype)
        key, index = split_key(copy.key)
        stored = self.located.get((copy.file, key))
        if stored is None:
            stored = self.located[(copy.file, key)] = self.inner.locate(dataclasses.replace(copy, key=key), stacked,
                                                                        dtype)
        return stored.narrowed(take(stored.view, index))
