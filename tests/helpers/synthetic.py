"""Synthetic checkpoints held in memory, for the engine alone: catalogs, a reader, a sink and a group of threads.

A synthetic checkpoint is drawn by hypothesis: random source tensors (shapes, dtypes, values), split into pieces
along dim 0, dim 1 or both as FSDP and DCP shard them, or replicated in several files as HSDP and buffers are; and
steps over them (pure casts, a split into two outputs, a fused concatenation, a transpose, a scaling). Beside
the catalog it keeps every output as torch computes it from the whole source tensors: the oracle the streamed
bytes are compared with, which never goes through merger's code.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from merger.catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from merger.engine.dist import Group
from merger.engine.plan import Plan, Runs
from merger.mapping.steps import OutputSpec, Step
from merger.output.safetensors_layout import file_layout
from merger.catalog import Stored

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
SIDE_FILES = ("lora_adapter/adapter_model.safetensors", "extra.safetensors")


@dataclass
class Synthetic:
    catalog: Catalog
    steps: list[Step]
    expected: dict[str, torch.Tensor]  # every output as torch computes it from `full`


class MemoryReader:
    """The PieceReader of a synthetic catalog: each copy's bytes are a tensor in `store[file][key]`.

    A `Stored` whose start is None holds its data in its view (file_reads.py), so nothing is written to disk.
    A rank may only read the files it opened: a route to a file of another rank fails the merge.
    """

    def __init__(self, catalog: Catalog, store: dict[str, dict[str, torch.Tensor]]):
        self.store, self.opened = store, set()

    def check_files(self, files: list[str]) -> None:
        self.opened.update(files)

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        if copy.file not in self.opened:
            raise AssertionError(f"read from {copy.file}, which this rank did not open")
        return Stored(copy.file, None, self.store[copy.file][copy.key])


class MemorySink:
    """Output files as byte arrays, each starting with its planned header as prepare_files writes it, plus a count
    of the writes that landed on every byte (ranks of a thread group share one sink)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.layouts = [file_layout(f) for f in plan.files]
        self.data = [bytearray(f.header) + bytearray(f.size - f.data_start) for f in self.layouts]
        self.writes = [np.zeros(f.size, dtype=np.int64) for f in self.layouts]
        self.lock = threading.Lock()

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        assert tensor.dtype == spec.dtype and tuple(tensor.shape) == spec.shape, spec
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        index, entry = self.plan.location[spec.name]
        raw = piece.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        data_start = self.layouts[index].data_start
        base, size = data_start + entry.begin, runs.length * piece.element_size()
        assert len(raw) == runs.count * size, spec.name
        for k, start in enumerate(runs.starts()):
            at = base + start * piece.element_size()
            assert start >= 0 and at + size <= data_start + entry.end, spec.name
            with self.lock:
                self.data[index][at:at + size] = raw[k * size:(k + 1) * size]
                self.writes[index][at:at + size] += 1


class _Hub:
    """What the ranks of a thread group share: one slot each, and a barrier (with a timeout: a bug never hangs)."""

    def __init__(self, world: int):
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def gather(self, rank: int, value: object) -> list:
        self.barrier.wait()  # the previous gather's slots were read by everyone
        self.slots[rank] = value
        self.barrier.wait()
        return list(self.slots)


class ThreadGroup(Group):
    """One rank of a merge group whose ranks are threads of this process: all_gather and the all_to_all of piece
    bytes go through shared memory instead of gloo, with the same contract as dist.Group."""

    def __init__(self, rank: int, world: int, hub: _Hub):
        super().__init__(rank, world)
        self.hub = hub

    def all_gather(self, value: object) -> list:
        return self.hub.gather(self.rank, value)

    def barrier(self) -> None:
        self.hub.barrier.wait()

    def exchange(self, send: torch.Tensor, send_split: list[int], recv: torch.Tensor,
                 recv_split: list[int]) -> torch.Tensor:
        sent = self.hub.gather(self.rank, (send, send_split))
        at = 0
        for peer, (block, split) in enumerate(sent):
            start = sum(split[:self.rank])
            assert split[self.rank] == recv_split[peer], (peer, self.rank, split, recv_split)
            recv[at:at + recv_split[peer]].copy_(block[start:start + split[self.rank]])
            at += recv_split[peer]
        self.hub.barrier.wait()  # every peer copied its block out before any sender reuses its buffer
        return recv


def run_in_threads(world: int, body) -> None:
    """body(group) on `world` thread ranks; the first failure is raised here (the others are released)."""
    hub = _Hub(world)
    errors: list[BaseException | None] = [None] * world

    def main(rank: int) -> None:
        try:
            body(ThreadGroup(rank, world, hub))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors[rank] = e
            hub.barrier.abort()

    threads = [threading.Thread(target=main, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread rank hung"
    # the failure itself, not the broken barrier it left the other ranks with
    for e in sorted((e for e in errors if e is not None), key=lambda e: isinstance(e, threading.BrokenBarrierError)):
        raise e


def _full(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:  # small values: a cast to float16 never overflows
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


@st.composite
def _pieces(draw, name: str, full: torch.Tensor, files: list[str],
            store: dict[str, dict[str, torch.Tensor]]) -> tuple[ShardPiece, ...]:
    """The tensor whole in one file, replicated in several, or cut into blocks along dim 0, dim 1 or both (FSDP
    Shard(0), Shard(1), a 2-D mesh), each block possibly with a replica. A tensor without elements may also come
    as one empty piece per file, as FSDP saves it. Every copy's data is put in `store`."""
    shape = tuple(full.shape)
    cuttable = [d for d in range(min(2, len(shape))) if shape[d] > 1]
    modes = ["whole", "replicated"] + [f"dim{d}" for d in cuttable] + ["grid"] * (len(cuttable) == 2)
    modes += ["empty"] * (full.numel() == 0)
    mode = draw(st.sampled_from(modes))
    cut = {"dim0": [0], "dim1": [1], "grid": [0, 1]}.get(mode, [])
    spans = []  # per dim, the (begin, end) of each block
    for d, n in enumerate(shape):
        bounds = [0, n]
        if d in cut:  # a wide dim is cut coarsely, as TP ranks cut a weight: runs long enough to place directly
            points = st.sampled_from(range(n // 4, n, n // 4)) if n >= 64 else st.integers(1, n - 1)
            bounds[1:1] = sorted(draw(st.sets(points, min_size=1, max_size=n - 1)))
        spans.append(list(zip(bounds, bounds[1:])))
    boxes = list(itertools.product(*spans))
    if mode == "empty":
        boxes *= draw(st.integers(1, len(files)))
    most = len(files) if mode == "replicated" else min(2, len(files))
    pieces = []
    for j, box in enumerate(boxes):
        data = full[tuple(slice(lo, hi) for lo, hi in box)].clone()
        copies = []
        for f in draw(st.lists(st.sampled_from(files), min_size=1, max_size=most, unique=True)):
            key = f"{name}#{j}"
            store.setdefault(f, {})[key] = data
            copies.append(PieceCopy(f, key))
        pieces.append(ShardPiece(tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box), tuple(copies)))
    return tuple(pieces)


def _split(dim: int, sizes: list[int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.split(tensors[0], sizes, dim=dim))


def _fuse(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(tensors, dim=0)]


def _transpose(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[0].t()]  # not contiguous: the sink must write it in row-major order all the same


def _double(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[0] * 2]


@st.composite
def synthetics(draw, max_tensors: int = 8) -> Synthetic:
    """A random checkpoint in 1 to 6 source files, and random steps over it."""
    files = [f"/synthetic/rank{r}.bin" for r in range(draw(st.integers(1, 6)))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    store: dict[str, dict[str, torch.Tensor]] = {}
    tensors, steps, expected = {}, [], {}
    spec_file = st.sampled_from((None, None, None) + SIDE_FILES)
    out_dtype = st.sampled_from(DTYPES)

    def source(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = _full(shape, dtype, gen)
        tensors[name] = SourceTensor(name, shape, dtype, draw(_pieces(name, t, files, store)))
        return t

    def output(name: str, value: torch.Tensor, dtype: torch.dtype) -> OutputSpec:
        expected[name] = value.to(dtype)
        return OutputSpec(name, tuple(value.shape), dtype, draw(spec_file))

    for i in range(draw(st.integers(1, max_tensors))):
        # layer numbers without leading zeros: distinct names keep distinct natural sort keys
        name = f"{draw(st.sampled_from(['model.layers', 'layers', 'embed', 'head']))}.{draw(st.integers(0, 12))}.w{i}"
        # now and then a wide matrix, whose column blocks are runs of at least plan.MIN_RUN_BYTES
        shape = tuple(draw(st.one_of(st.lists(st.integers(0, 7), min_size=0, max_size=3),
                                     st.tuples(st.integers(1, 3), st.sampled_from((1024, 1536))))))
        dtype = draw(st.sampled_from(DTYPES))
        kinds = ["cast", "cast", "double", "unused"] + ["split", "fuse"] * bool(shape)
        kinds += ["transpose"] * (len(shape) == 2)
        kind = draw(st.sampled_from(kinds))
        t = source(name, shape, dtype)
        if kind == "cast":  # the reader casts: route dtypes are the output's
            steps.append(Step((name,), (output(name, t, draw(out_dtype)),)))
        elif kind == "double":
            steps.append(Step((name,), (output(name, t + t, draw(out_dtype)),), _double))
        elif kind == "transpose":
            steps.append(Step((name,), (output(name, t.permute(1, 0), draw(out_dtype)),), _transpose))
        elif kind == "split":  # e.g. a fused gate_up into gate and up
            dim = draw(st.integers(0, len(shape) - 1))
            k = draw(st.integers(0, shape[dim]))
            parts = (t.narrow(dim, 0, k), t.narrow(dim, k, shape[dim] - k))
            specs = tuple(output(f"{name}.{part}", v, draw(out_dtype)) for part, v in zip("ab", parts))
            steps.append(Step((name,), specs, partial(_split, dim, [k, shape[dim] - k])))
        elif kind == "fuse":  # e.g. q, k, v into one qkv
            other = f"{name}.other"
            u = source(other, (draw(st.integers(0, 5)),) + shape[1:], dtype)
            value = torch.from_numpy(np.concatenate([_numpy(t), _numpy(u)])).view(t.dtype)
            steps.append(Step((name, other), (output(name, value, draw(out_dtype)),), _fuse))
    catalog = Catalog("synthetic", Path("/synthetic"), tensors, files, partial(MemoryReader, store=store))
    return Synthetic(catalog, steps, expected)


def single_tensor_steps(names: list[str]) -> tuple[Catalog, list[Step]]:
    """One float32 element per name, whole in one file, each cast to an output of the same name."""
    store: dict[str, dict[str, torch.Tensor]] = {"/synthetic/rank0.bin": {}}
    tensors, steps = {}, []
    for name in names:
        store["/synthetic/rank0.bin"][name] = torch.zeros(1)
        piece = ShardPiece((0,), (1,), (PieceCopy("/synthetic/rank0.bin", name),))
        tensors[name] = SourceTensor(name, (1,), torch.float32, (piece,))
        steps.append(Step((name,), (OutputSpec(name, (1,), torch.float32),)))
    return Catalog("synthetic", Path("/synthetic"), tensors, list(store), partial(MemoryReader, store=store)), steps


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as numpy holds them (bfloat16 as int16: numpy has no bfloat16)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@st.composite
def plan_args(draw, min_world: int = 1) -> dict:
    """World size and budgets, small enough against the synthetic tensors that files and batches split often."""
    return dict(world=draw(st.integers(min_world, 8)), max_shard_size=draw(st.integers(1, 6000)),
                max_inflight=draw(st.integers(0, 20000)))
