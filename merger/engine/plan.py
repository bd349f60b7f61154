"""From a catalog and a list of steps to a complete, deterministic merge plan.

The steps come from the mapping (mapping/steps.py): a cast or a pure transform whose output names, shapes and
dtypes are declared up front. `plan_layout` then fixes everything before any data moves: the output
files, each tensor's byte range in its file's data section, the rank that writes each step, the copy of
each piece to read and the rank that reads it, and the batches that keep every rank under its memory budget.
The header before each data section is the output format's, not the plan's (output/safetensors_layout.py).
The plan is a plain value: every rank computes the same one, `inspect` prints it, tests compare it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from ..catalog import Catalog, ShardPiece, row_major_index
from ..errors import MergerError
from ..hf_folder import shard_name
from ..mapping.steps import OutputSpec, Step, Tie
from ..safetensors_io import TensorEntry, place_tensors
from .routes import COLUMNS, Routes, RouteTable


@dataclass(frozen=True)
class Batch:
    steps: tuple[int, ...]
    routes: Routes
    out_bytes: int


@dataclass(frozen=True)
class OutputFile:
    name: str
    entries: tuple[TensorEntry, ...]  # in file order; begin and end count from the start of the data section
    indexed: bool = True  # one of the model's weight files (in its index), not a side file like an adapter

    @property
    def data_bytes(self) -> int:
        """The data section's bytes: what max_shard_size limits and the index's total_size counts. The file is its
        header longer, which the output lays out (output/safetensors_layout.py: a file's total size, data start)."""
        return self.entries[-1].end if self.entries else 0


@dataclass
class Plan:
    steps: list[Step]
    # The rank that writes each step; None: placed directly, each piece written by the rank that read it.
    writers: list[int | None]
    files: list[OutputFile]
    location: dict[str, tuple[int, TensorEntry]]  # output name -> (file index, entry)
    batches: list[Batch]
    world: int
    max_inflight: int
    tie: Tie | None = None  # lm_head.weight, left out as tied to the input embedding: what --verify checks it by

    @property
    def direct(self) -> bool:
        return any(w is None for w in self.writers)

    @property
    def in_parts(self) -> bool:
        """Some output is written in parts (placed directly, or in slabs): the sink must take parts (put_part)."""
        return self.direct or any(o.rows is not None for step in self.steps for o in step.outputs)

    @property
    def total_bytes(self) -> int:
        """Every output's bytes, headers left out: what the stream writes, and what progress and summaries count."""
        return sum(e.end - e.begin for _, e in self.location.values())

    @property
    def model_files(self) -> list[OutputFile]:
        return [f for f in self.files if f.indexed]

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: self.files[i].name for name, (i, _) in self.location.items() if self.files[i].indexed}


def natural_key(name: str) -> tuple:
    """'layers.10' after 'layers.9': digits compare as numbers, so files hold tensors in layer order.
    isdecimal, not isdigit: '¹' is a digit that \\d does not split off and int() refuses."""
    return tuple(int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", name))


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


def _check_steps(catalog: Catalog, steps: list[Step]) -> None:
    slabs: dict[str, list[OutputSpec]] = {}
    for step in steps:
        for name in step.inputs:
            if name not in catalog.tensors:
                raise MergerError(f"plan needs source tensor {name}, which the checkpoint lacks, {catalog.root}")
        for spec in step.outputs:
            slabs.setdefault(spec.name, []).append(spec)
    for name, specs in slabs.items():
        if len(specs) == 1 and specs[0].rows is None:
            continue
        whole = {dataclasses.replace(s, rows=None) for s in specs}
        rows = sorted(s.rows for s in specs if s.rows is not None)
        if len(rows) < len(specs) or len(whole) != 1:
            raise MergerError(f"two source tensors map to output {name}, {catalog.root}")
        if [lo for lo, _ in rows] != [0, *(hi for _, hi in rows[:-1])] or rows[-1][1] != specs[0].shape[0]:
            raise MergerError(f"the slabs of output {name} (rows {rows}) do not tile its {specs[0].shape[0]} rows, "
                              f"{catalog.root}")


def _tensors(outputs: list[OutputSpec]) -> list[OutputSpec]:
    """Each output tensor once, whole, where its first spec is: a tensor written in slabs is one entry."""
    seen: dict[str, OutputSpec] = {}
    for spec in outputs:
        seen.setdefault(spec.name, dataclasses.replace(spec, rows=None))
    return list(seen.values())


# A run shorter than this costs more as its own write (a syscall each: about 2 us, so 1 KiB runs land at 0.5 GB/s)
# than as bytes through the exchange; tensors cut that finely go the assembling way.
MIN_RUN_BYTES = 512


@dataclass(frozen=True)
class Runs:
    """Where a block piece's elements lie in its tensor's row-major order: runs of `length` consecutive elements,
    one per index of the `outer` box, the first at `start`, `strides` elements apart along each of the box's
    dims. A row block (Shard(0)) is one run; a column block (Shard(1)) one run per row."""

    start: int
    length: int
    outer: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return math.prod(self.outer)

    def starts(self):
        """The element index of each run, in the piece's own row-major order."""
        if len(self.outer) == 1 and self.strides[0]:  # a column block: the common case, no per-run arithmetic
            return range(self.start, self.start + self.outer[0] * self.strides[0], self.strides[0])
        # (a stride of 0: a later dim is 0, so are the runs; range() refuses a step of 0)
        return (self.start + sum(i * s for i, s in zip(index, self.strides))
                for index in itertools.product(*map(range, self.outer)))


def slab_runs(spec: OutputSpec) -> Runs:
    """The one run of elements a slab of output `spec` (spec.rows) fills: its rows are consecutive in row-major
    order."""
    row = math.prod(spec.shape[1:])
    return Runs(spec.rows[0] * row, (spec.rows[1] - spec.rows[0]) * row)


def block_runs(shape: tuple[int, ...], piece: ShardPiece) -> Runs:
    """The runs of `piece` in a tensor of `shape`: the dims after the last one the piece cuts are whole, so each
    run spans them and the cut dim's part; the dims before it form the box of runs."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    d = len(shape) - 1
    while d > 0 and piece.sizes[d] == shape[d]:
        d -= 1
    outer = [(n, strides[k]) for k, n in enumerate(piece.sizes[:max(d, 0)]) if n != 1]
    length = piece.sizes[d] * strides[d] if shape else 1
    return Runs(row_major_index(shape, piece.offsets), length, tuple(n for n, _ in outer),
                tuple(s for _, s in outer))


def places_directly(catalog: Catalog, step: Step, pieces: tuple[ShardPiece, ...]) -> bool:
    """A pure cast whose pieces tile the output in runs of its bytes (verl FSDP and FSDP2 Shard(0) blocks are one
    run each; Megatron's row-parallel weights and DTensor Shard(1) blocks one run per row): the rank that reads a
    piece casts it and writes each run at its offset, and nothing crosses ranks. Pieces that do not cover the
    tensor exactly, or runs under MIN_RUN_BYTES, go the assembling way."""
    if not step.is_cast or len(step.inputs) != 1 or len(step.outputs) != 1 or step.outputs[0].rows is not None:
        return False
    tensor, spec = catalog.tensors[step.inputs[0]], step.outputs[0]
    if tensor.shape != spec.shape or sum(p.numel for p in pieces) != math.prod(spec.shape):
        return False
    for piece in pieces:
        if piece.sizes[1:] == spec.shape[1:]:
            continue  # a block of whole rows (FSDP's Shard(0)): one run
        runs = block_runs(spec.shape, piece)
        if runs.count > 1 and runs.length * spec.dtype.itemsize < MIN_RUN_BYTES:
            return False
    return True


def plan_layout(catalog: Catalog, steps: list[Step], world: int, max_shard_size: int,
                max_inflight: int, direct: bool = True, tie: Tie | None = None) -> Plan:
    """`direct`: place pure casts directly (the sink writes parts of a tensor at their offsets, as the file
    writer does); False assembles every output whole at one rank. `tie`: the mapping's left-out lm_head."""
    _check_steps(catalog, steps)
    steps = sorted(steps, key=lambda s: (natural_key(s.outputs[0].name), s.outputs[0].rows or (0, 0))
                   if s.outputs else ())
    outputs = _tensors([spec for step in steps for spec in step.outputs])

    # no model file at all when every output goes to a side file (an adapter folder as the whole target)
    groups = [g for g in _layout_files([s for s in outputs if s.file is None], max_shard_size) if g]
    named = [(shard_name(i, len(groups)), g, True) for i, g in enumerate(groups)]
    side: dict[str, list[OutputSpec]] = {}
    for spec in outputs:
        if spec.file is not None:
            side.setdefault(spec.file, []).append(spec)
    named += [(name, group, False) for name, group in side.items()]
    files, location = [], {}
    for i, (name, group, indexed) in enumerate(named):
        entries = place_tensors([(s.name, s.dtype, s.shape) for s in group])
        files.append(OutputFile(name, tuple(entries), indexed))
        for entry in entries:
            location[entry.name] = (i, entry)

    writers, batches = _route(catalog, steps, world, max_inflight, direct)
    return Plan(steps, writers, files, location, batches, world, max_inflight, tie)


def rerouted(plan: Plan, catalog: Catalog, world: int) -> Plan:
    """The same outputs in the same files, placed as the plan places them, routed for `world` ranks: one layout
    planned for several worlds (benchmarks/scale.py); `inspect --merge_ranks` plans for its world directly."""
    if world == plan.world:
        return plan
    writers, batches = _route(catalog, plan.steps, world, plan.max_inflight, plan.direct)
    return dataclasses.replace(plan, writers=writers, batches=batches, world=world)


def _input_arrays(catalog: Catalog, step: Step, owner: dict[str, int],
                  ranks_of: dict[tuple[str, ...], np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per input of `step`, its pieces' sizes (a row each) and the rank that opened each one's only copy, when
    the catalog gives the pieces as arrays (dcp_chunk_table.TablePieces.one_copy_columns): no object per piece.
    None: some input's pieces come only as objects. `ranks_of` caches each file list's owners."""
    out = []
    for name in step.inputs:
        columns = getattr(catalog.tensors[name].pieces, "one_copy_columns", None)
        if columns is None:
            return None
        sizes, file, files = columns()
        ranks = ranks_of.get(key := tuple(files))
        if ranks is None:
            ranks = ranks_of[key] = np.array([owner.get(f, -1) for f in files] or [-1], dtype=np.int64)
        out.append((sizes, ranks[file]))
    return out


def _rows_place_directly(catalog: Catalog, step: Step, sizes: np.ndarray) -> bool | None:
    """places_directly for pieces given as their sizes: None when that takes the pieces' runs (a piece that is not
    a block of whole rows), which the object path works out."""
    if not step.is_cast or len(step.inputs) != 1 or len(step.outputs) != 1 or step.outputs[0].rows is not None:
        return False
    tensor, spec = catalog.tensors[step.inputs[0]], step.outputs[0]
    if tensor.shape != spec.shape or int(sizes.prod(axis=1).sum()) != math.prod(spec.shape):
        return False
    return True if (sizes[:, 1:] == np.array(spec.shape[1:], dtype=np.int64)).all() else None


def _route(catalog: Catalog, steps: list[Step], world: int, max_inflight: int,
           direct: bool) -> tuple[list[int | None], list[Batch]]:
    """Who writes each step, who reads each piece, and the batches."""
    # Writers: a directly placed step is written where its pieces are read. Any other step goes to its home,
    # the rank that opened the most of its input bytes (an expert of one EP rank, a tensor of one file: then
    # nothing crosses ranks), while that rank has written less than an even share of the output; else to
    # the rank with the fewest bytes written so far, so writing spreads evenly however the inputs lie.
    # Readers: a piece is read from a copy the writer opened itself when there is one, else from the copy whose
    # owner has read the least so far.
    # A catalog that gives its pieces as arrays (each with one copy, so nothing to choose) is routed on the arrays;
    # any other, piece by piece. Both give the same plan.
    owner = catalog.file_owner(world)
    load, read_load = [0] * world, [0] * world
    share = sum(o.nbytes for step in steps for o in step.outputs) / world
    writers: list[int | None] = []
    columns = {name: array(code) for name, code in COLUMNS.items()}  # one entry per route: no object each
    step_rows = [0]  # step si's routes are rows step_rows[si]:step_rows[si + 1]
    all_wires, ranks_of = [], {}
    for si, step in enumerate(steps):
        wires = [step.outputs[0].dtype if step.is_cast and len(step.inputs) == 1 else catalog.tensors[n].dtype
                 for n in step.inputs]
        arrays = _input_arrays(catalog, step, owner, ranks_of)
        placed = _rows_place_directly(catalog, step, arrays[0][0]) if direct and arrays else False
        pieces = None
        if arrays is None or placed is None:
            arrays = None
            pieces = [tuple(catalog.tensors[n].pieces) for n in step.inputs]  # made once: a catalog may make them lazily
            placed = direct and places_directly(catalog, step, pieces[0] if pieces else ())
        if placed:
            writer = None
        else:
            held = [0] * world  # input bytes each rank opened a copy of
            for ii, wire in enumerate(wires):
                if arrays is not None:
                    sizes, ranks = arrays[ii]
                    for r, n in _per_rank(ranks, sizes.prod(axis=1) * wire.itemsize, world):
                        held[r] += n
                    continue
                for piece in pieces[ii]:
                    for r in {owner[c.file] for c in piece.copies}:
                        held[r] += piece.numel * wire.itemsize
            home = min(range(world), key=lambda r: (-held[r], load[r], r))
            writer = home if load[home] < share else min(range(world), key=lambda r: (load[r], r))
        writers.append(writer)
        for ii, wire in enumerate(wires):
            if arrays is not None:
                sizes, readers = arrays[ii]
                chosen, nbytes = np.zeros(len(readers), dtype=np.int64), sizes.prod(axis=1) * wire.itemsize
                for r, n in _per_rank(readers, nbytes, world):
                    read_load[r] += n
                    if writer is None:
                        load[r] += n
            else:
                chosen, readers, nbytes = _choose_copies(pieces[ii], wire, owner, writer, load, read_load)
            n = len(chosen)
            for name, values in zip(COLUMNS, (np.full(n, si), np.full(n, ii), np.arange(n), chosen, readers,
                                              readers if writer is None else np.full(n, writer), nbytes)):
                columns[name].frombytes(np.asarray(values, dtype=np.dtype(COLUMNS[name])).tobytes())
        if writer is not None:
            load[writer] += sum(s.nbytes for s in step.outputs)
        step_rows.append(len(columns["step"]))
        all_wires.append(wires)

    # Two batches are in flight at once (stream.py reads one while it writes the other): each gets half.
    table = RouteTable(catalog, steps, all_wires, columns)
    return writers, _batches(steps, writers, table, step_rows, world, max_inflight // 2)


def _per_rank(ranks: np.ndarray, nbytes: np.ndarray, world: int):
    """(rank, total of `nbytes` over the pieces at that rank) for each rank with any, as Python ints."""
    total = np.zeros(world, dtype=np.int64)
    np.add.at(total, ranks, nbytes)
    return zip(np.flatnonzero(total).tolist(), total[total != 0].tolist())


def _choose_copies(pieces: tuple[ShardPiece, ...], wire: torch.dtype, owner: dict[str, int], writer: int | None,
                   load: list[int], read_load: list[int]) -> tuple[list[int], list[int], list[int]]:
    """For pieces as objects, in order: the copy each is read from, its reader, its bytes in flight; adds them
    to `read_load` (and to `load` when the step is placed directly: `writer` None)."""
    chosen, readers, sizes = [], [], []
    for piece in pieces:
        copies = piece.copies
        if len(copies) == 1:  # the common case: nothing to choose
            j = 0
        else:
            local = [j for j, c in enumerate(copies) if owner[c.file] == writer]
            j = local[0] if local else min(
                range(len(copies)), key=lambda j: (read_load[owner[copies[j].file]], owner[copies[j].file]))
        reader = owner[copies[j].file]
        nbytes = piece.numel * wire.itemsize
        read_load[reader] += nbytes
        if writer is None:
            load[reader] += nbytes
        chosen.append(j)
        readers.append(reader)
        sizes.append(nbytes)
    return chosen, readers, sizes


def _step_memory(step: Step, writer: int | None, table: RouteTable, rows: slice, world: int) -> np.ndarray:
    """Bytes each rank holds at once for one step (its routes: `rows` of `table`): read, sent and received
    pieces, assembled inputs, outputs."""
    mem = np.zeros(world, dtype=np.int64)
    reader, nbytes = table.reader[rows], table.nbytes[rows]
    if writer is None:  # each piece is read, cast and written where it is
        np.add.at(mem, reader, nbytes)
        return mem
    mem[writer] += int(nbytes.sum()) + sum(s.nbytes for s in step.outputs)  # assembled inputs, outputs
    crossing = reader != writer
    np.add.at(mem, reader[crossing], nbytes[crossing])
    mem[writer] += int(nbytes[crossing].sum())
    return mem


def _batches(steps: list[Step], writers: list[int | None], table: RouteTable, step_rows: list[int],
             world: int, max_inflight: int) -> list[Batch]:
    """Consecutive steps grouped while no rank's memory for the group exceeds max_inflight.

    A step larger than the budget on its own forms a batch alone: the budget bounds everything else.
    """
    batches: list[Batch] = []
    current: list[int] = []
    mem = np.zeros(world, dtype=np.int64)

    def close():
        if current:
            rows = np.arange(step_rows[current[0]], step_rows[current[-1] + 1], dtype=np.int64)
            out = sum(s.nbytes for si in current for s in steps[si].outputs)
            batches.append(Batch(tuple(current), Routes(table, rows), out))

    for si, step in enumerate(steps):
        need = _step_memory(step, writers[si], table, slice(step_rows[si], step_rows[si + 1]), world)
        if current and bool((mem + need > max_inflight).any()):
            close()
            current, mem = [], np.zeros(world, dtype=np.int64)
        current.append(si)
        mem += need
    close()
    return batches


def traffic(plan: Plan) -> list[dict[str, int]]:
    """Per rank, the bytes the plan has it read from the source, send to and receive from other ranks, and
    write to the output."""
    read, sent, received, written = (np.zeros(plan.world, dtype=np.int64) for _ in range(4))
    placed = np.array([w is None for w in plan.writers] or [False])  # by step: written where its pieces are read
    for batch in plan.batches:
        routes = batch.routes
        reader, writer, nbytes = routes.reader, routes.writer, routes.nbytes
        np.add.at(read, reader, routes.stored_nbytes())
        crossing = reader != writer
        np.add.at(sent, reader[crossing], nbytes[crossing])
        np.add.at(received, writer[crossing], nbytes[crossing])
        direct = placed[routes.step]
        np.add.at(written, writer[direct], nbytes[direct])
        for si in batch.steps:
            if plan.writers[si] is not None:
                written[plan.writers[si]] += sum(o.nbytes for o in plan.steps[si].outputs)
    return [dict(read_bytes=int(r), sent_bytes=int(s), received_bytes=int(v), written_bytes=int(w))
            for r, s, v, w in zip(read, sent, received, written)]
