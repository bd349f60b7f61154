"""From a catalog and a list of steps to a complete, deterministic merge plan.

A `Step` turns whole source tensors into output tensors through a pure function whose output names, shapes
and dtypes are declared up front. `plan_layout` then fixes everything before any data moves: the output
files and their safetensors headers, each tensor's byte offset, the rank that writes each step, the copy of
each piece to read and the rank that reads it, and the batches that keep every rank under its memory budget.
The plan is a plain value: every rank computes the same one, `inspect` prints it, tests compare it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from .catalog import Catalog, PieceCopy, ShardPiece
from .errors import MergerError
from .safetensors_io import TensorEntry, build_header, nbytes_of


@dataclass(frozen=True)
class OutputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # A file of its own beside the model's weights (e.g. `lora_adapter/adapter_model.safetensors`), left out of
    # the model's index; None: one of the model's sharded files.
    file: str | None = None

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


def identity(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


@dataclass(frozen=True)
class Step:
    """Whole source tensors in, output tensors out. `fn` is pure; the writer casts results to each spec's dtype."""

    inputs: tuple[str, ...]
    outputs: tuple[OutputSpec, ...]
    fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] = identity


@dataclass(frozen=True)
class Route:
    """One piece of one step input, from the rank that reads it to the rank that writes the step.

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


@dataclass(frozen=True)
class Batch:
    steps: tuple[int, ...]
    routes: tuple[Route, ...]
    out_bytes: int


@dataclass(frozen=True)
class OutputFile:
    name: str
    prefix: bytes  # length + JSON header: the data section starts right after it
    entries: tuple[TensorEntry, ...]
    indexed: bool = True  # one of the model's weight files (in its index), not a side file like an adapter

    @property
    def size(self) -> int:
        return len(self.prefix) + (self.entries[-1].end if self.entries else 0)


@dataclass
class Plan:
    steps: list[Step]
    writers: list[int]
    files: list[OutputFile]
    location: dict[str, tuple[int, TensorEntry]]  # output name -> (file index, entry)
    batches: list[Batch]
    world: int

    @property
    def total_bytes(self) -> int:
        return sum(e.end - e.begin for _, e in self.location.values())

    @property
    def model_files(self) -> list[OutputFile]:
        return [f for f in self.files if f.indexed]

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: self.files[i].name for name, (i, _) in self.location.items() if self.files[i].indexed}


def natural_key(name: str) -> tuple:
    """'layers.10' after 'layers.9': digits compare as numbers, so files hold tensors in layer order."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def output_dtype(source: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """The cast a merge applies: floating tensors take the wanted dtype, integer buffers keep theirs."""
    return wanted if wanted is not None and source.is_floating_point else source


def _layout_files(outputs: list[OutputSpec], max_shard_size: int) -> list[list[OutputSpec]]:
    groups: list[list[OutputSpec]] = [[]]
    size = 0
    for spec in outputs:
        if groups[-1] and size + spec.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def _file_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _check_steps(catalog: Catalog, steps: list[Step]) -> None:
    seen: set[str] = set()
    for step in steps:
        for name in step.inputs:
            if name not in catalog.tensors:
                raise MergerError(f"plan needs source tensor {name}, which the checkpoint lacks, {catalog.root}")
        for spec in step.outputs:
            if spec.name in seen:
                raise MergerError(f"two source tensors map to output {spec.name}, {catalog.root}")
            seen.add(spec.name)


def plan_layout(catalog: Catalog, steps: list[Step], world: int, max_shard_size: int,
                max_inflight: int) -> Plan:
    _check_steps(catalog, steps)
    steps = sorted(steps, key=lambda s: natural_key(s.outputs[0].name) if s.outputs else ())
    outputs = [spec for step in steps for spec in step.outputs]

    # no model file at all when every output goes to a side file (an adapter folder as the whole target)
    groups = [g for g in _layout_files([s for s in outputs if s.file is None], max_shard_size) if g]
    named = [(_file_name(i, len(groups)), g, True) for i, g in enumerate(groups)]
    side: dict[str, list[OutputSpec]] = {}
    for spec in outputs:
        if spec.file is not None:
            side.setdefault(spec.file, []).append(spec)
    named += [(name, group, False) for name, group in side.items()]
    files, location = [], {}
    for i, (name, group, indexed) in enumerate(named):
        prefix, entries = build_header([(s.name, s.dtype, s.shape) for s in group])
        files.append(OutputFile(name, prefix, tuple(entries), indexed))
        for entry in entries:
            location[entry.name] = (i, entry)

    # Writers: each step goes to the rank with the fewest output bytes so far, so writing spreads evenly.
    load = [0] * world
    writers = []
    for step in steps:
        w = min(range(world), key=lambda r: (load[r], r))
        writers.append(w)
        load[w] += sum(s.nbytes for s in step.outputs)

    # Readers: a piece is read from a copy the writer opened itself when there is one, else from the copy
    # whose owner has read the least so far.
    owner = catalog.file_owner(world)
    read_load = [0] * world
    step_routes: list[list[Route]] = []
    for si, step in enumerate(steps):
        routes = []
        for ii, name in enumerate(step.inputs):
            tensor = catalog.tensors[name]
            wire = step.outputs[0].dtype if step.fn is identity and len(step.inputs) == 1 else tensor.dtype
            for piece in tensor.pieces:
                local = [c for c in piece.copies if owner[c.file] == writers[si]]
                copy = local[0] if local else min(piece.copies, key=lambda c: (read_load[owner[c.file]], owner[c.file]))
                route = Route(si, ii, piece, copy, owner[copy.file], writers[si], wire, tensor.dtype)
                read_load[route.reader] += route.nbytes
                routes.append(route)
        step_routes.append(routes)

    # Two batches are in flight at once (stream.py reads one while it writes the other): each gets half.
    return Plan(steps, writers, files, location, _batches(steps, writers, step_routes, world, max_inflight // 2),
                world)


def _step_memory(step: Step, writer: int, routes: list[Route], world: int) -> list[int]:
    """Bytes each rank holds at once for one step: sent and received pieces, assembled inputs, outputs."""
    mem = [0] * world
    mem[writer] += sum(r.nbytes for r in routes) + sum(s.nbytes for s in step.outputs)  # assembled inputs, outputs
    for r in routes:
        if r.reader != r.writer:
            mem[r.reader] += r.nbytes
            mem[r.writer] += r.nbytes
    return mem


def _batches(steps: list[Step], writers: list[int], step_routes: list[list[Route]],
             world: int, max_inflight: int) -> list[Batch]:
    """Consecutive steps grouped while no rank's memory for the group exceeds max_inflight.

    A step larger than the budget on its own forms a batch alone: the budget bounds everything else.
    """
    batches: list[Batch] = []
    current: list[int] = []
    mem = [0] * world

    def close():
        if current:
            routes = tuple(r for si in current for r in step_routes[si])
            out = sum(s.nbytes for si in current for s in steps[si].outputs)
            batches.append(Batch(tuple(current), routes, out))

    for si, step in enumerate(steps):
        need = _step_memory(step, writers[si], step_routes[si], world)
        if current and any(m + n > max_inflight for m, n in zip(mem, need)):
            close()
            current, mem = [], [0] * world
        current.append(si)
        mem = [m + n for m, n in zip(mem, need)]
    close()
    return batches
