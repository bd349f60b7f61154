"""Executing a plan: batch by batch, read local pieces, exchange them, assemble, transform, hand to a sink.

Every rank walks the same batches. In each one it reads the pieces it was routed from the files it opened,
sends each to the rank that writes its step (one all_to_all), assembles whole inputs from local and
received pieces by their offsets, runs the step, and gives each output to the sink (a file writer, or the
comparison of `merger test`). Memory per rank is what one batch holds, bounded by the plan's budget.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .catalog import Catalog
from .dist import Group
from .errors import MergerError, describe_error
from .plan import Batch, OutputSpec, Plan, Route
from .progress import Progress


class Sink(Protocol):
    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        """Receive one finished output tensor, already in `spec`'s dtype and shape."""


def _place(box: torch.Tensor, offsets: tuple[int, ...], piece: torch.Tensor) -> None:
    view = box
    for d, (o, s) in enumerate(zip(offsets, piece.shape)):
        view = view.narrow(d, o, s)
    view.copy_(piece)


def _assemble(catalog: Catalog, name: str, routes: list[tuple[Route, torch.Tensor]]) -> torch.Tensor:
    source = catalog.tensors[name]
    if len(routes) == 1 and routes[0][0].piece.sizes == source.shape:
        return routes[0][1]  # the whole tensor in one piece: no copy
    box = torch.empty(source.shape, dtype=routes[0][0].dtype if routes else source.dtype)
    covered = 0
    for route, data in routes:
        _place(box, route.piece.offsets, data)
        covered += route.piece.numel
    if covered != box.numel():
        raise MergerError(f"pieces of tensor {name} cover {covered} of {box.numel()} elements, {catalog.root}")
    return box


def _run_step(plan: Plan, catalog: Catalog, si: int, pieces: list[tuple[Route, torch.Tensor]], sink: Sink) -> None:
    step = plan.steps[si]
    inputs = [_assemble(catalog, name, [(r, t) for r, t in pieces if r.input == ii])
              for ii, name in enumerate(step.inputs)]
    results = step.fn(inputs)
    if len(results) != len(step.outputs):
        raise MergerError(f"step for {step.outputs[0].name} produced {len(results)} tensors, "
                          f"planned {len(step.outputs)}")
    for spec, tensor in zip(step.outputs, results):
        if tuple(tensor.shape) != spec.shape:
            raise MergerError(f"output {spec.name} came out {tuple(tensor.shape)}, planned {spec.shape}")
        sink.put(spec, tensor.to(spec.dtype))


def _read_batch(batch: Batch, group: Group, reader) -> tuple[dict[int, torch.Tensor], list[list[torch.Tensor]]]:
    """This rank's pieces of the batch: those it writes itself, and per peer those it sends."""
    local: dict[int, torch.Tensor] = {}
    sends: list[list[torch.Tensor]] = [[] for _ in range(group.world)]
    for i, route in enumerate(batch.routes):
        if route.reader != group.rank:
            continue
        # Copy (and cast) out of the mapped file at once, then hand its pages back: at most one piece of
        # the source is ever resident, however large the batch.
        data = reader.read(route.copy, route.piece, route.stored).to(route.dtype, copy=True)
        reader.release()
        if route.writer == group.rank:
            local[i] = data
        else:
            sends[route.writer].append(data)
    return local, sends


def _receive(batch: Batch, group: Group, local: dict[int, torch.Tensor], sends: list[list[torch.Tensor]]) -> None:
    """One all_to_all: every piece reaches its writer; received pieces are added to `local` by route index."""
    me = group.rank
    incoming = [(i, r) for i, r in enumerate(batch.routes) if r.writer == me and r.reader != me]
    recv_bytes = [0] * group.world
    for _, r in incoming:
        recv_bytes[r.reader] += r.nbytes
    received = group.exchange(sends, recv_bytes)
    cursor = [0] * group.world
    for i, route in incoming:
        start = cursor[route.reader]
        cursor[route.reader] += route.nbytes
        local[i] = received[route.reader][start:start + route.nbytes].view(route.dtype).reshape(route.piece.sizes)


def _write_batch(plan: Plan, catalog: Catalog, batch: Batch, me: int, local: dict[int, torch.Tensor],
                 sink: Sink) -> None:
    by_step: dict[int, list[tuple[Route, torch.Tensor]]] = {}
    for i, route in enumerate(batch.routes):
        if route.writer == me:
            by_step.setdefault(route.step, []).append((route, local.pop(i)))
    for si in batch.steps:
        if plan.writers[si] == me:
            _run_step(plan, catalog, si, by_step.pop(si, []), sink)  # pop: each step's pieces die with it


class BatchObserver(Protocol):
    """Optional hooks around batches (the merge uses them to fsync and checksum files as they complete)."""

    def written(self, index: int) -> None:
        """This rank has handed its outputs of batch `index` to the sink (a failure here counts as a write error)."""

    def confirmed(self, count: int) -> None:
        """A sync point has shown that every rank wrote batches [0, count) without error."""


def run_plan(plan: Plan, catalog: Catalog, group: Group, sink: Sink, progress: Progress | None = None,
             debug: bool = False, reader=None, observer: BatchObserver | None = None) -> None:
    """Stream the whole plan through `sink`. Raises MergerError on every rank if any rank fails.

    Each batch has two sync points: after reading (so no rank enters the exchange when a peer could not
    read its pieces) and the exchange itself; a write failure is reported at the next batch's first one.
    `reader`, when given, was opened and checked already (the merge checks files before creating output).
    """
    error = None
    if reader is None:
        reader = catalog.open_reader()
        try:
            reader.check_files(catalog.files_of_rank(group.rank, group.world))
        except Exception as e:  # noqa: BLE001 - every failure must reach the sync point, or peers would hang
            error = describe_error(e, group.rank, debug)
    for index, batch in enumerate(plan.batches):
        local, sends = {}, []
        if error is None:
            try:
                local, sends = _read_batch(batch, group, reader)
            except Exception as e:  # noqa: BLE001
                error = describe_error(e, group.rank, debug)
        group.agree(error)
        if observer:
            observer.confirmed(index)
        if group.distributed:
            _receive(batch, group, local, sends)
        del sends
        try:
            _write_batch(plan, catalog, batch, group.rank, local, sink)
            if observer:
                observer.written(index)
        except Exception as e:  # noqa: BLE001
            error = describe_error(e, group.rank, debug)
        del local
        if progress and error is None:
            progress.advance(batch.out_bytes)
    group.agree(error)
    if observer:
        observer.confirmed(len(plan.batches))
