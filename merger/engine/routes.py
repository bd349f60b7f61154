"""A plan's routes as columns of numbers, not a Python object per piece.

A 671B checkpoint saved by 64 ranks has 2.9 M pieces; a Route object (with its ShardPiece and PieceCopy) for
each held the plan at several GiB on every rank. The plan keeps, per route, the indices that name it (step,
input, piece of that input's tensor, copy of that piece) and the numbers the stream sorts pieces by (reader,
writer, bytes in flight); the Route objects are made only for the rows a rank asks for, a batch at a time.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..catalog import Catalog, PieceCopy, ShardPiece
from ..mapping.steps import Step


@dataclass(frozen=True, slots=True)
class Route:
    """One piece of one step input, from the rank that reads it to the rank that writes it: the step's writer,
    or the reader itself when the step is placed directly (`Plan.writers[step]` is None).

    `dtype` is the dtype the piece travels and is assembled in: the output dtype for a pure cast (the reader
    casts, so fp32 -> bf16 moves half the bytes), the source dtype when a transform needs the original values.
    """

    step: int
    input: int
    piece: ShardPiece
    copy: PieceCopy
    reader: int
    writer: int
    dtype: torch.dtype  # in flight and assembled
    stored: torch.dtype  # in the source file

    @property
    def nbytes(self) -> int:
        return self.piece.numel * self.dtype.itemsize


# Each column's array typecode: 32-bit indices and ranks, 64-bit byte counts.
COLUMNS = {"step": "i", "input": "i", "piece": "i", "copy": "i", "reader": "i", "writer": "i", "nbytes": "q"}


class RouteTable:
    """Every route of a plan, one row each in plan order (by step, then input, then piece), as numpy columns:
    `piece` indexes the input tensor's pieces, `copy` that piece's copies, `nbytes` is the piece's bytes in
    flight. `wires[step][input]` is the dtype an input travels in."""

    __slots__ = ("catalog", "steps", "wires", "first_input", "wire_size", "stored_size", *COLUMNS)

    def __init__(self, catalog: Catalog, steps: list[Step], wires: list[list[torch.dtype]],
                 columns: dict[str, array]):
        """`columns`: an array of COLUMNS' typecode for each column, taken over as it is (no copy)."""
        self.catalog, self.steps, self.wires = catalog, steps, wires
        for name, code in COLUMNS.items():
            setattr(self, name, np.frombuffer(columns[name], dtype=np.dtype(code)))
        # each step input's itemsizes, in flight and stored, at first_input[step] + input
        self.first_input = np.cumsum([0] + [len(s.inputs) for s in steps], dtype=np.int64)
        self.wire_size = np.array([d.itemsize for per_step in wires for d in per_step], dtype=np.int64)
        self.stored_size = np.array([catalog.tensors[n].dtype.itemsize for s in steps for n in s.inputs],
                                    dtype=np.int64)

    def stored_nbytes(self, rows: np.ndarray) -> np.ndarray:
        """The bytes each of `rows` takes in the source file (its stored dtype's, not its wire dtype's)."""
        at = self.first_input[self.step[rows]] + self.input[rows]
        return self.nbytes[rows] // self.wire_size[at] * self.stored_size[at]

    def made(self, rows: np.ndarray) -> list[Route]:
        """The Route of each of `rows`. Of each step input's pieces, only the span from the first to the last one
        asked for is made, with one slice (a catalog may make pieces from arrays of its own when asked, as
        dcp_chunk_table.TablePieces does: a rank of 64 asks for one piece of each tensor, not all 64)."""
        listed = list(zip(*(getattr(self, n)[rows].tolist() for n in list(COLUMNS)[:-1])))
        span: dict[tuple[int, int], list[int]] = {}  # (step, input) -> [first, last] piece asked for
        for si, ii, k, *_ in listed:
            first_last = span.setdefault((si, ii), [k, k])
            first_last[0], first_last[1] = min(first_last[0], k), max(first_last[1], k)
        pieces = {key: self.catalog.tensors[self.steps[key[0]].inputs[key[1]]].pieces[first:last + 1]
                  for key, (first, last) in span.items()}
        routes = []
        for si, ii, k, c, reader, writer in listed:
            piece = pieces[si, ii][k - span[si, ii][0]]
            stored = self.catalog.tensors[self.steps[si].inputs[ii]].dtype
            routes.append(Route(si, ii, piece, piece.copies[c], reader, writer, self.wires[si][ii], stored))
        return routes


class Routes(Sequence):
    """Some rows of a RouteTable (a batch's routes), a sequence of Route made as it is read. Its columns (`step`,
    `reader`, `writer`, `nbytes`) are arrays over the same rows, for work that needs no Route object."""

    __slots__ = ("table", "rows")

    def __init__(self, table: RouteTable, rows: np.ndarray):
        self.table, self.rows = table, rows

    def column(self, name: str) -> np.ndarray:
        return getattr(self.table, name)[self.rows]

    @property
    def step(self) -> np.ndarray:
        return self.column("step")

    @property
    def reader(self) -> np.ndarray:
        return self.column("reader")

    @property
    def writer(self) -> np.ndarray:
        return self.column("writer")

    @property
    def nbytes(self) -> np.ndarray:
        return self.column("nbytes")

    def stored_nbytes(self) -> np.ndarray:
        return self.table.stored_nbytes(self.rows)

    def at(self, positions: np.ndarray) -> list[Route]:
        """The routes at `positions` (indices into this sequence), in that order."""
        return self.table.made(self.rows[positions])

    def where(self, keep: np.ndarray) -> Routes:
        """The routes whose entry of the boolean array `keep` is true."""
        return Routes(self.table, self.rows[keep])

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.table.made(self.rows))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self.table.made(self.rows[i]))
        return self.table.made(self.rows[[i]])[0]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Routes({tuple(self)!r})"
