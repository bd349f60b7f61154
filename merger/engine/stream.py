"""Executing a plan: batch by batch, read local pieces, exchange them, assemble, transform, hand to a sink.

Every rank walks the same batches. In each one it reads the pieces it was routed from the files it opened,
sends each to the rank that writes its step (one all_to_all), assembles whole inputs from local and
received pieces by their offsets, runs the step, and gives each output to the sink (a file writer, or the
comparison of `merger test`). Memory per rank is what two batches hold (one read while the previous one is
written), bounded by the plan's budget.
"""
from __future__ import annotations

import functools
import gc
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ..catalog import Catalog
from ..errors import AgreedError, Failure, MergerError, failure_of
from ..mapping.steps import OutputSpec
from ..sources.file_reads import CHUNK, Placed, SourceReads, pread_into, source_shrank
from .dist import Group
from .overflow import may_have_overflowed, overflow_message, overflowed
from .plan import Batch, Plan, Runs, block_runs, slab_runs
from .progress import Progress
from .routes import Route, Routes


@runtime_checkable
class Sink(Protocol):
    """Receives finished outputs: what every sink does."""

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        """Receive one finished output tensor, already in `spec`'s dtype and shape."""


@runtime_checkable
class PartSink(Sink, Protocol):
    """A sink for a plan that places steps directly (plan.py), as every sink merger has is: each rank hands over
    the pieces it read, cast, with the runs of the tensor they fill (plan.Runs), and no tensor is assembled."""

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        """Receive one piece of output `spec`, filling `runs` of it."""


@runtime_checkable
class CopyingSink(PartSink, Protocol):
    """A sink that takes a directly placed piece needing no cast from its source file itself: the piece then never
    enters this process (FileSink's copy inside the kernel), or is read where it lies, a chunk at a time (a
    comparison, the tie check: read_in_place)."""

    def copy_part(self, spec: OutputSpec, runs: Runs, source: int, source_at: int, source_name: str) -> Placed:
        """Take the piece's bytes, contiguous in the open file `source` from byte `source_at`; return where they
        are to be checked against their torch.save record."""


PAGE = 4096  # batch buffers start on a page, so that a piece can lie where a page of its file would (AligningSink)


@runtime_checkable
class AligningSink(PartSink, Protocol):
    """A sink that writes pieces from the batch buffers after it was handed them (FileSink's direct writes, past
    the page cache), where they lie in memory as they will in the file: modulo a PAGE. The stream lays out a
    rank's own directly placed pieces so, hands them over with put_lasting, and leaves each batch's buffers
    unchanged until the sink's flush_writes at the end of the batch."""

    def alignment(self, spec: OutputSpec, runs: Runs, nbytes: int) -> int | None:
        """Where in a PAGE of memory a piece of `nbytes` of output `spec`, filling `runs`, should start; None for
        anywhere."""

    def put_lasting(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        """put_part for a piece that stays unchanged until flush_writes returns."""

    def flush_writes(self) -> None:
        """Return once the pieces handed over are written: their memory is then free to reuse."""


def read_in_place(runs: Runs, item: int, source: int, source_at: int, file: str,
                  use: Callable[[int, torch.Tensor], None]) -> Placed:
    """For a sink that reads an unchanged piece where it lies instead of copying it (a comparison, a checksum):
    its copy_part hands `use` the piece's bytes, contiguous in the open file `source` from byte `source_at`, a
    CHUNK at a time (the index in the tensor of the chunk's first element, a uint8 tensor), so no batch buffer
    holds the piece. Returns where its bytes are to be checked against their torch.save record: in the source
    itself, nothing being copied."""
    size = runs.length * item
    for k, start in enumerate(runs.starts()):
        at = source_at + k * size
        for lo in range(0, size, CHUNK):
            chunk = torch.empty(min(CHUNK, size - lo), dtype=torch.uint8)
            if pread_into(source, memoryview(chunk.numpy()), at + lo) < chunk.numel():
                raise source_shrank(file, at + lo + chunk.numel())
            use(start + lo // item, chunk)
    return Placed(file, source, [(source_at, runs.count * size)])


def _copier(plan: Plan, copy_part: Callable | None, route: Route):
    """For a piece this rank places directly and writes exactly as stored (no cast), when the sink can copy it
    from the source file itself (`copy_part`, a CopyingSink's): the function that copies it
    (SourceReads.copy_unchanged calls it). None: the piece is read into memory."""
    if copy_part is None or plan.writers[route.step] is not None or route.dtype != route.stored:
        return None
    spec = plan.steps[route.step].outputs[0]
    return functools.partial(copy_part, spec, block_runs(spec.shape, route.piece))


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


def _run_step(plan: Plan, catalog: Catalog, si: int, pieces: list[tuple[Route, torch.Tensor]], sink: Sink,
              overflows: set[int]) -> None:
    step = plan.steps[si]
    inputs = [_assemble(catalog, name, [(r, t) for r, t in pieces if r.input == ii])
              for ii, name in enumerate(step.inputs)]
    results = step.run(inputs)
    if len(results) != len(step.outputs):
        raise MergerError(f"step for {step.outputs[0].name} produced {len(results)} tensors, "
                          f"planned {len(step.outputs)}")
    for spec, tensor in zip(step.outputs, results):
        if tuple(tensor.shape) != spec.written_shape:
            raise MergerError(f"output {spec.name} came out {tuple(tensor.shape)}, planned {spec.written_shape}")
        out = tensor.to(spec.dtype)
        if overflowed(tensor, out):
            overflows.add(si)
        if spec.rows is None:
            sink.put(spec, out)
        else:  # a slab: its rows of the tensor, which other steps write the rest of
            sink.put_part(spec, slab_runs(spec), out)


_ALIGN = 64


def _slot(nbytes):
    """Bytes a piece of `nbytes` (an int, or an array of them) takes in a batch buffer: its size rounded up, so
    every piece starts aligned for any dtype."""
    return -(-nbytes // _ALIGN) * _ALIGN


class BatchBuffers:
    """The two buffers a set of batches reuses: pieces this rank reads, and pieces it receives.

    A fresh tensor per piece costs a page fault and zero-filling per page, about as much as the copy that
    fills it; reused buffers are faulted in once. Each is allocated at the largest size any of its batches
    needs (the plan knows them all): grown batch by batch, it would be faulted in anew at every growth. In the
    read buffer the pieces for each peer lie in rank order, so the bytes to send are one block and go out
    without a gathering copy; the rank's own come last, each with up to a PAGE before it to lie as its sink
    asks (AligningSink).
    """

    def __init__(self, batches: list[Batch], me: int):
        def largest(counted: Callable[[Routes], np.ndarray], padded: Callable[[Routes], np.ndarray] | None = None
                    ) -> int:
            return max((int(_slot(b.routes.nbytes[counted(b.routes)]).sum())
                        + (PAGE * int(padded(b.routes).sum()) if padded else 0) for b in batches), default=0)

        self.read = _page_aligned(largest(lambda r: r.reader == me, lambda r: (r.reader == me) & (r.writer == me)))
        self.recv = torch.empty(largest(lambda r: (r.writer == me) & (r.reader != me)), dtype=torch.uint8)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of `nbytes` that starts on a PAGE."""
    whole = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -whole.data_ptr() % PAGE
    return whole[skip:skip + nbytes]


def _read_batch(plan: Plan, batch: Batch, group: Group, reader, reads: SourceReads, buffers: BatchBuffers,
                copy_part: Callable | None, align: Callable | None, overflows: set[int]
                ) -> tuple[dict[int, tuple[Route, torch.Tensor | None]], torch.Tensor, list[int]]:
    """This rank's pieces of the batch: those it writes itself, with their routes, by route index (None: copied
    into the output already, see _copier), and the block it sends with the bytes for each peer. Steps whose pieces
    lost values in the cast are added to `overflows`. `align`: an AligningSink's alignment."""
    me = group.rank
    read_here = np.flatnonzero(batch.routes.reader == me)
    writer = batch.routes.writer[read_here]
    order = read_here[np.lexsort((read_here, writer, writer == me))]  # by (written here, writer, route index)
    mine = list(zip(order.tolist(), batch.routes.at(order)))
    reads.will_read(reader, ((r.copy, r.piece, r.stored) for _, r in mine))  # a bucket's objects fetched in this order
    buf = buffers.read
    local: dict[int, tuple[Route, torch.Tensor | None]] = {}
    send_split = [0] * group.world
    at = 0
    for i, route in mine:
        stored = reader.locate(route.copy, route.piece, route.stored)
        # One check for every format: the copy would otherwise fill a wrong shape and cast a wrong dtype silently.
        if tuple(stored.view.shape) != route.piece.sizes or stored.view.dtype != route.stored:
            raise MergerError(f"tensor {route.copy.key} is {tuple(stored.view.shape)} {stored.view.dtype} here, "
                              f"the plan expects {route.piece.sizes} {route.stored}, {route.copy.file}")
        copier = _copier(plan, copy_part, route)
        if copier is not None and reads.copy_unchanged(stored, route.copy.key, copier):
            local[i] = route, None  # written: the pieces a rank writes itself come last, so the send block is unchanged
            continue
        if route.writer == me and align is not None and plan.writers[route.step] is None:
            spec = plan.steps[route.step].outputs[0]
            phase = align(spec, block_runs(spec.shape, route.piece), route.nbytes)
            if phase is not None and phase % route.dtype.itemsize == 0:  # else a view of that dtype could not start there
                at += (phase - at) % PAGE
        out = buf[at:at + route.nbytes].view(route.dtype).view(route.piece.sizes)
        at = _slot(at + route.nbytes)  # the next piece aligned for any dtype again, after one placed off the grid
        reads.copy(stored, out, route.copy.key)
        if may_have_overflowed(out):  # rare: only then is the piece read again, as stored, to compare
            source = torch.empty(route.piece.sizes, dtype=route.stored)
            reads.copy(stored, source, route.copy.key)
            if overflowed(source, out):
                overflows.add(route.step)
        if route.writer == me:
            local[i] = route, out
        else:
            send_split[route.writer] += _slot(route.nbytes)
    reads.batch_read()
    return local, buf[:sum(send_split)], send_split


def _receive(batch: Batch, group: Group, local: dict[int, tuple[Route, torch.Tensor | None]], send: torch.Tensor,
             send_split: list[int], buffers: BatchBuffers) -> None:
    """One all_to_all: every piece reaches its writer; received pieces are added to `local` (with their routes) by
    route index."""
    me = group.rank
    positions = np.flatnonzero((batch.routes.writer == me) & (batch.routes.reader != me))
    incoming = list(zip(positions.tolist(), batch.routes.at(positions)))
    recv_split = [0] * group.world
    for _, r in incoming:
        recv_split[r.reader] += _slot(r.nbytes)
    received = group.exchange(send, send_split, buffers.recv[:sum(recv_split)], recv_split)
    cursor = [sum(recv_split[:r]) for r in range(group.world)]  # each peer's block, pieces in route order
    for i, route in incoming:
        start = cursor[route.reader]
        cursor[route.reader] += _slot(route.nbytes)
        local[i] = route, received[start:start + route.nbytes].view(route.dtype).view(route.piece.sizes)


class BatchObserver(Protocol):
    """Optional hooks around batches (the merge uses them to fsync and checksum files as they complete)."""

    def step_written(self, step: int) -> None:
        """This rank has handed step `step`'s outputs to the sink."""

    def written(self, index: int) -> None:
        """This rank has handed its outputs of batch `index` to the sink (a failure here counts as a write error)."""

    def confirmed(self, count: int) -> None:
        """A sync point has shown that every rank wrote batches [0, count) without error."""


def _write_batch(plan: Plan, catalog: Catalog, batch: Batch, me: int,
                 local: dict[int, tuple[Route, torch.Tensor | None]],
                 sink: Sink, observer: BatchObserver | None, overflows: set[int]) -> None:
    # pieces in the batch buffers: unchanged until the sink's flush_writes, which the caller calls (a plan that
    # places no piece directly may go to a sink of whole tensors)
    put = sink.put_lasting if isinstance(sink, AligningSink) else sink.put_part if isinstance(sink, PartSink) else None
    by_step: dict[int, list[tuple[Route, torch.Tensor]]] = {}
    here = batch.routes.writer == me
    elsewhere = set(batch.routes.step[~here].tolist())  # directly placed steps that other ranks write part of
    if len(local) != int(here.sum()):  # a piece neither read nor received here would leave its bytes unwritten
        raise MergerError(f"rank {me} holds {len(local)} of the {int(here.sum())} pieces it writes in this batch")
    for i in sorted(local):  # every piece this rank writes: read here or received, in route order
        route, piece = local.pop(i)
        by_step.setdefault(route.step, []).append((route, piece))
    for si in batch.steps:  # pop: pieces die with their step
        writer = plan.writers[si]
        if writer == me:
            _run_step(plan, catalog, si, by_step.pop(si, []), sink, overflows)
        elif writer is None and si in by_step:
            spec = plan.steps[si].outputs[0]
            for route, piece in by_step.pop(si):  # cast by the reader already (the route's dtype is spec's)
                if piece is not None:  # None: copied from the source file while reading
                    put(spec, block_runs(spec.shape, route.piece), piece)
        else:
            continue
        if observer and si not in elsewhere and all(o.rows is None for o in plan.steps[si].outputs):
            # every byte of the step's outputs was written here (a slab's tensor is known written, by whichever
            # ranks wrote its other slabs, only at the sync point after its last batch)
            observer.step_written(si)


def run_plan(plan: Plan, catalog: Catalog, group: Group, sink: Sink, progress: Progress | None = None,
             debug: bool = False, reader=None, observer: BatchObserver | None = None,
             allow_overflow: bool = False) -> None:
    """Stream the whole plan through `sink`. Raises MergerError on every rank if any rank fails, and after the
    last batch when a cast to float16 lost values (overflow.py), unless `allow_overflow`."""
    # The catalog, the plan and torch's modules live to the end: exempt them from the garbage collector, whose
    # full passes would otherwise walk them all again and again while the batches allocate. Unfrozen after, or
    # whatever was alive now (a caller's garbage cycles, triton's bindings: nanobind then reports them as leaked
    # at exit) could never be collected in a process that goes on.
    if plan.in_parts and not isinstance(sink, PartSink):  # checked once, before any byte moves
        raise TypeError(f"{type(sink).__name__} takes no parts (put_part), and the plan writes outputs in parts")
    gc.freeze()
    try:
        _stream_plan(plan, catalog, group, sink, progress, debug, reader, observer, allow_overflow)
    finally:
        gc.unfreeze()


def _stream_plan(plan: Plan, catalog: Catalog, group: Group, sink: Sink, progress: Progress | None, debug: bool,
                 reader, observer: BatchObserver | None, allow_overflow: bool) -> None:
    """run_plan's work.

    Reading and writing overlap: while a writer thread writes batch k, the main thread reads batch k + 1
    into the other set of buffers (so two batches are in flight; the plan gives each half the budget).
    Each batch has two sync points: after reading and after the previous batch is written (so no rank
    enters the exchange when a peer could not read its pieces, and a failed write stops every rank before
    the next exchange), and the exchange itself.
    `reader`, when given, was opened and checked already (the merge checks files before creating output).
    """
    error = None
    overflows: set[int] = set()  # steps whose float16 cast made an inf; added to by both threads
    copy_part = sink.copy_part if isinstance(sink, CopyingSink) else None  # asked once, not for every piece
    align = sink.alignment if isinstance(sink, AligningSink) else None
    if reader is None:
        reader = catalog.open_reader()
        try:
            reader.check_files(catalog.files_of_rank(group.rank, group.world))
        except Exception as e:  # noqa: BLE001 - every failure must reach the sync point, or peers would hang
            error = failure_of(e, group.rank, debug)

    def write(index: int, batch: Batch, local: dict[int, tuple[Route, torch.Tensor | None]]) -> Failure | None:
        try:
            _write_batch(plan, catalog, batch, group.rank, local, sink, observer, overflows)
            if align is not None:  # the batch's buffers are read into again two batches on
                sink.flush_writes()
            if observer:
                observer.written(index)
        except Exception as e:  # noqa: BLE001 - reported at the next sync point
            return failure_of(e, group.rank, debug)
        if progress:
            progress.advance(batch.out_bytes)
        return None

    buffers = (BatchBuffers(plan.batches[0::2], group.rank), BatchBuffers(plan.batches[1::2], group.rank))
    reads = SourceReads()
    writing: Future | None = None
    with ThreadPoolExecutor(1, thread_name_prefix="merger-write") as writer:
        for index, batch in enumerate(plan.batches):
            local, send, send_split = {}, torch.empty(0, dtype=torch.uint8), [0] * group.world
            if error is None:
                try:
                    local, send, send_split = _read_batch(plan, batch, group, reader, reads, buffers[index % 2],
                                                          copy_part, align, overflows)
                except Exception as e:  # noqa: BLE001
                    error = failure_of(e, group.rank, debug)
            if writing is not None:
                error = error or writing.result()
            group.agree(error)
            if observer:
                observer.confirmed(index)
            if group.distributed:
                _receive(batch, group, local, send, send_split, buffers[index % 2])
            del send
            writing = writer.submit(write, index, batch, local)
            del local
        if writing is not None:
            error = error or writing.result()
    try:
        if error is None:
            reads.finish()
    except Exception as e:  # noqa: BLE001 - reported at the sync point
        error = failure_of(e, group.rank, debug)
    finally:
        reads.close()
    group.agree(error)
    if observer:
        observer.confirmed(len(plan.batches))
    lost = sorted({o.name for share in group.all_gather(sorted(overflows)) for si in share
                   for o in plan.steps[si].outputs})
    if lost and not allow_overflow:
        raise AgreedError(overflow_message(lost, str(catalog.root)))
