"""Ranks of one host write an output file past the page cache (FileSink with direct=True, output/direct_writes.py):
each piece's aligned middle through O_DIRECT, its edges buffered.

Oracles: torch's own indexing for where each piece's rows land, and the kernel's page cache (mincore) for
whether bytes went past it: written directly, a page is not cached; written buffered, it is.
"""
import contextlib
import errno
import mmap
import os
import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from merger.catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from merger.engine.dist import Group
from merger.engine.plan import OutputFile, block_runs, plan_layout
from merger.engine.stream import run_plan
from merger.mapping.steps import OutputSpec, Step
from merger.errors import MergerError
from merger.output import direct_writes
from merger.output.files import FileSink, prepare_files
from merger.output.safetensors_layout import file_layout
from merger.safetensors_io import place_tensors
from tests.helpers.files import cached_pages, takes_o_direct, tmpfs
from tests.helpers.synthetic import MemoryReader

pytestmark = pytest.mark.unit

SHAPE = (96, 8191)  # bfloat16 rows of 16382 bytes: pieces start and end off the 4 KiB grid
(ENTRY,) = place_tensors([("w", torch.bfloat16, SHAPE)])
FILE = OutputFile("model.safetensors", (ENTRY,))
HEADER = file_layout(FILE).header
PAGE = mmap.PAGESIZE


class _OneTensor:
    """The least of a plan FileSink writes through: one file holding one bfloat16 tensor after its header."""

    def __init__(self):
        self.files = [FILE]
        self.location = {"w": (0, ENTRY)}

    def create(self, folder: Path) -> Path:
        path = folder / self.files[0].name
        with open(path, "wb") as f:
            f.write(HEADER)
            f.truncate(len(HEADER) + self.location["w"][1].end)
        return path


SPEC = SimpleNamespace(name="w", dtype=torch.bfloat16, shape=SHAPE)
# Row blocks of the tensor, dealt to two ranks in turn: from one row (16 KiB, buffered whole) to 40 (640 KiB).
ROWS = [(0, 40), (40, 41), (41, 60), (60, 61), (61, 96)]


def _write(tmp_path: Path, direct: bool, ranks: list[FileSink] | None = None) -> tuple[Path, torch.Tensor]:
    """The tensor's row blocks written by two sinks (two ranks; made here unless given) taking turns; both closed,
    whatever happens."""
    whole = torch.randn(SHAPE).to(torch.bfloat16)
    plan = _OneTensor()
    path = plan.create(tmp_path)
    ranks = ranks if ranks is not None else [FileSink(tmp_path, plan, direct=direct) for _ in range(2)]
    with contextlib.ExitStack() as closing:
        for sink in ranks:
            closing.callback(sink.close)
        for k, (lo, hi) in enumerate(ROWS):
            piece = SimpleNamespace(offsets=(lo, 0), sizes=(hi - lo, SHAPE[1]))
            ranks[k % 2].put_part(SPEC, block_runs(SHAPE, piece), whole[lo:hi].contiguous())
    return path, whole


def test_two_ranks_write_one_file_past_the_page_cache(tmp_path):
    """The file holds every row where torch's indexing puts it; the pages of the large pieces' middles were never
    cached, those of their edges and of the one-row pieces were."""
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    path, whole = _write(tmp_path, direct=True)
    cached = cached_pages(path)
    row = SHAPE[1] * 2
    direct_pages, buffered_pages = set(), set()
    for lo, hi in ROWS:
        start, end = len(HEADER) + lo * row, len(HEADER) + hi * row
        inside = range(-(-start // PAGE), (end // PAGE))  # pages the piece fills whole
        (direct_pages if end - start >= direct_writes.SMALLEST else buffered_pages).update(inside)
    assert direct_pages and buffered_pages
    assert not any(cached[p] for p in direct_pages)
    assert all(cached[p] for p in buffered_pages)
    assert path.read_bytes() == HEADER + whole.view(torch.uint8).numpy().tobytes()


def test_buffered_writes_stay_in_the_page_cache(tmp_path):
    """The same writes without direct: every page of the file is cached (what the test above tells apart)."""
    path, whole = _write(tmp_path, direct=False)
    assert all(cached_pages(path))
    assert path.read_bytes() == HEADER + whole.view(torch.uint8).numpy().tobytes()


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    """Where opening with O_DIRECT fails with EINVAL (tmpfs before Linux 6.6, some FUSE mounts), the sink writes
    everything buffered from then on: the same bytes, every page cached."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    path, whole = _write(tmp_path, direct=True)
    monkeypatch.undo()
    assert all(cached_pages(path))
    assert path.read_bytes() == HEADER + whole.view(torch.uint8).numpy().tobytes()


def test_a_direct_write_that_fails_on_its_thread_is_one_clear_error(tmp_path):
    """On a 768 KiB tmpfs, which takes the first 640 KiB piece (written and waited for: the filesystem takes
    O_DIRECT) but not the 1.5 MiB tensor, the disk fills up under a write in flight on the direct-write thread:
    it is reported as one MergerError naming the file, as a buffered write that fails is."""
    with tmpfs(tmp_path / "mnt", "size=768k") as mnt:
        if not takes_o_direct(mnt):
            pytest.skip(f"this kernel's tmpfs refuses O_DIRECT writes (Linux 6.6 and later take them), {mnt}")
        ranks = [FileSink(mnt, _OneTensor(), direct=True) for _ in range(2)]
        with pytest.raises(MergerError) as failed:
            _write(mnt, True, ranks)
        assert ranks[0].direct.proven and ranks[0].direct.error is not None  # failed after the first, on the thread
        path = mnt / "model.safetensors"
        assert str(failed.value) == f"cannot write the merged model (No space left on device), {path}"


def test_a_wait_for_the_writes_handed_over_so_far_ends_while_later_ones_are_still_held(tmp_path, monkeypatch):
    """Three 64 KiB direct writes handed over, a mark taken after the second, each write held on the write thread
    until the test lets it go. wait_written(mark) waits for the first two only, in order: it ends once the second is
    in the file, while the third is still held (a writer that keeps handing writes over cannot hold back a checksum
    thread waiting for its block's, as a wait for an empty queue could); flush then waits for the third."""
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    size = 64 << 10
    path = tmp_path / "out"
    path.write_bytes(bytes(3 * size))
    gates = [threading.Event() for _ in range(3)]
    turns = iter(gates)  # one write thread: the writes reach it in the order they were handed over
    pwrite_all = direct_writes._pwrite_all

    def held(fd, file, data, at):
        assert next(turns).wait(30)
        pwrite_all(fd, file, data, at)

    monkeypatch.setattr(direct_writes, "_pwrite_all", held)
    writes = direct_writes.DirectWrites(True)
    writes.proven = True  # else the first write is made at once, to learn whether the filesystem takes them
    pieces = []
    for k, fill in enumerate(b"abc"):
        piece = memoryview(mmap.mmap(-1, size))  # page-aligned: written from where it is, no bounce buffer
        piece[:] = bytes([fill]) * size
        pieces.append(piece)
        assert writes.write(path, piece, k * size, lasting=True) == size
        if k == 1:
            mark = writes.mark()
    waiter = threading.Thread(target=writes.wait_written, args=(mark,))
    try:
        waiter.start()
        gates[0].set()
        waiter.join(0.3)
        assert waiter.is_alive()  # the second write is still held
        gates[1].set()
        waiter.join(30)
        assert not waiter.is_alive()
        assert path.read_bytes() == b"a" * size + b"b" * size + bytes(size)  # the third is still held
    finally:
        for gate in gates:
            gate.set()
        writes.flush()
        writes.shutdown()
        writes.close_all()
    assert path.read_bytes() == b"a" * size + b"b" * size + b"c" * size


def _lasting(tmp_path: Path, aligned: bool) -> tuple[Path, torch.Tensor]:
    """The tensor's row blocks handed by one rank alone on its host (no bounce buffers) to put_lasting from a
    page-aligned buffer, each piece laid out where the sink asks (`alignment`) or a byte off the grid."""
    whole = torch.randn(SHAPE).to(torch.bfloat16)
    plan = _OneTensor()
    path = plan.create(tmp_path)
    sink = FileSink(tmp_path, plan, direct=True, bounce=False)
    buffer = memoryview(mmap.mmap(-1, 4 * whole.numel()))  # page-aligned, as the stream's batch buffers are
    try:
        at = 0
        for lo, hi in ROWS:
            piece = SimpleNamespace(offsets=(lo, 0), sizes=(hi - lo, SHAPE[1]))
            runs, nbytes = block_runs(SHAPE, piece), (hi - lo) * SHAPE[1] * 2
            phase = sink.alignment(SPEC, runs, nbytes)
            at += ((phase if phase is not None else 0) - at) % PAGE + (0 if aligned else 2)
            slot = torch.frombuffer(buffer[at:at + nbytes], dtype=torch.bfloat16).view(hi - lo, SHAPE[1])
            slot.copy_(whole[lo:hi])
            sink.put_lasting(SPEC, runs, slot)
            at += nbytes
        sink.flush_writes()
    finally:
        sink.close()
    return path, whole


def test_a_rank_alone_writes_pieces_from_its_buffers_past_the_page_cache(tmp_path):
    """Pieces that lie in memory where the sink asked (their file offsets modulo a page) go direct from there,
    with no bounce buffer: their middles never entered the page cache; the one-row pieces did."""
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    path, whole = _lasting(tmp_path, aligned=True)
    cached, row = cached_pages(path), SHAPE[1] * 2
    for lo, hi in ROWS:
        start, end = len(HEADER) + lo * row, len(HEADER) + hi * row
        inside = [cached[p] for p in range(-(-start // PAGE), end // PAGE)]
        assert not any(inside) if end - start >= direct_writes.SMALLEST else all(inside), (lo, hi)
    assert path.read_bytes() == HEADER + whole.view(torch.uint8).numpy().tobytes()


def test_a_rank_alone_writes_pieces_off_the_grid_buffered(tmp_path):
    """Without bounce buffers, pieces that lie off the grid in memory are written buffered: the same bytes, every
    page cached."""
    path, whole = _lasting(tmp_path, aligned=False)
    assert all(cached_pages(path))
    assert path.read_bytes() == HEADER + whole.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("allocate", [True, False])
def test_output_files_are_created_with_their_blocks_reserved_for_direct_writes(allocate, tmp_path):
    """prepare_files with `allocate` reserves every block of the file (the kernel's st_blocks), which reads as the
    header and zeros all the same; without it the file is a hole past its header."""
    plan = _OneTensor()
    size = len(HEADER) + ENTRY.end
    prepare_files(tmp_path, plan, allocate=allocate)
    path = tmp_path / "model.safetensors"
    if allocate and path.stat().st_blocks * 512 < size:
        pytest.skip(f"the filesystem of {tmp_path} has no fallocate")
    assert (path.stat().st_blocks * 512 >= size) is allocate
    assert path.read_bytes() == HEADER + bytes(size - len(HEADER))


def test_pieces_of_mixed_dtypes_laid_out_for_direct_writes_load_as_written(tmp_path):
    """One rank streams a bfloat16 output of 3 elements, so that the next one (large enough to go direct) and the
    float32 ones after it lie 2 bytes off a 4-byte edge in the file: each piece is laid out in the batch buffer at
    its file offset modulo a page where its dtype allows, else on a 64-byte edge, and the file safetensors loads
    holds torch's casts of the sources."""
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    gen = torch.Generator().manual_seed(0)
    file = "/synthetic/rank0.bin"
    shapes = {"a.bias": ((3,), torch.bfloat16), "a.weight": ((40000,), torch.bfloat16),
              "b.weight": ((30000,), torch.float32), "c.weight": ((3, 9000), torch.float32)}
    store, tensors, steps, expected = {file: {}}, {}, [], {}
    for name, (shape, dtype) in shapes.items():
        source = store[file][name] = torch.randn(shape, generator=gen)
        piece = ShardPiece((0,) * len(shape), shape, (PieceCopy(file, name),))
        tensors[name] = SourceTensor(name, shape, torch.float32, (piece,))
        steps.append(Step((name,), (OutputSpec(name, shape, dtype),)))
        expected[name] = source.to(dtype)
    catalog = Catalog("synthetic", Path("/synthetic"), tensors, [file], partial(MemoryReader, store=store))
    plan = plan_layout(catalog, steps, 1, 1 << 30, 1 << 30)
    prepare_files(tmp_path, plan)
    sink = FileSink(tmp_path, plan, direct=True, bounce=False)
    try:
        run_plan(plan, catalog, Group(), sink)
    finally:
        sink.close()
    assert sink.direct.proven  # the pieces' middles went direct
    written = load_file(tmp_path / plan.files[0].name)
    assert written.keys() == expected.keys() and all(torch.equal(written[n], expected[n]) for n in expected)
