"""A merge's source reads leave the page cache as they found it (merger/io/local.py): a file that was not cached
has its pages dropped once a batch has read them, whether this process read them or the kernel copied them into the
output for it, and a cached one stays cached. Oracle: the kernel's own account of the file's cached pages (mincore of
a mapping, tests/helpers/files.py), and the bytes read or copied against the file's."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import torch

from merger.catalog import Stored
from merger.io.local import FOLIO, LocalStorage
from merger.sources.file_reads import Placed, SourceReads, geometry
from tests.helpers.files import cached_pages

pytestmark = pytest.mark.unit

SIZE = 64 << 20
CHUNK = 1 << 20


def _source(tmp_path: Path, cached: bool) -> tuple[Path, bytes]:
    """A file of SIZE random bytes, on disk, then all in the page cache or none of it (skipped where the
    filesystem keeps its files in memory, as a tmpfs does)."""
    data = os.urandom(SIZE)
    path = tmp_path / "rank_0.pt"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if any(cached_pages(path)):
        pytest.skip(f"the filesystem of {tmp_path} keeps the file's pages in memory (a tmpfs): nothing to drop")
    if cached:
        assert path.read_bytes() == data
        assert all(cached_pages(path))
    return path, data


def _read(storage: LocalStorage, path: Path, batches: int = 4) -> bytes:
    """The file read a CHUNK at a time in `batches` batches, each chunk's bytes in reverse order of the batch (as a
    merge reads a layer's tensors in another order than they are stored), drop_read after each batch."""
    out = bytearray(SIZE)
    per_batch = SIZE // batches
    for start in range(0, SIZE, per_batch):
        for at in reversed(range(start, start + per_batch, CHUNK)):
            assert storage.read_into(str(path), memoryview(out)[at:at + CHUNK], at) == CHUNK
        storage.drop_read()
    storage.close()
    return bytes(out)


def test_a_source_that_was_not_cached_is_not_left_in_the_cache(tmp_path):
    path, data = _source(tmp_path, cached=False)
    assert _read(LocalStorage(drop_cold=True), path) == data
    left = sum(cached_pages(path)) * os.sysconf("SC_PAGE_SIZE")
    assert left <= 2 * FOLIO, f"{left} bytes of the file left in the page cache"
    # the same reads, pages kept: what the drop saves
    assert _read(LocalStorage(), path) == data and all(cached_pages(path))


def test_a_source_that_was_cached_stays_cached(tmp_path):
    path, data = _source(tmp_path, cached=True)
    assert _read(LocalStorage(drop_cold=True), path) == data
    assert all(cached_pages(path))


def test_a_source_copied_inside_the_kernel_is_not_left_in_the_cache(tmp_path):
    """Pieces wanted as stored (`--dtype keep`) go from the source file to the output by copy_file_range
    (SourceReads.copy_unchanged, FileSink.copy_part): the kernel reads the source's pages into the cache for it."""
    path, data = _source(tmp_path, cached=False)
    out = tmp_path / "model.safetensors"
    reads = SourceReads()
    with open(out, "wb+") as target:
        def place(fd: int, at: int, file: str) -> Placed:  # the copy inside the kernel, as FileSink.copy_part's
            assert os.copy_file_range(fd, target.fileno(), CHUNK, at, at) == CHUNK
            return Placed(str(out), target.fileno(), [(at, CHUNK)])

        for start in range(0, SIZE, SIZE // 4):
            for at in reversed(range(start, start + SIZE // 4, CHUNK)):
                piece = Stored(str(path), 0, geometry(torch.uint8, (CHUNK,), (1,), at, SIZE))
                assert reads.copy_unchanged(piece, "weight", place)
            reads.batch_read()
        reads.close()
    assert out.read_bytes() == data
    left = sum(cached_pages(path)) * os.sysconf("SC_PAGE_SIZE")
    assert left <= 2 * FOLIO, f"{left} bytes of the file left in the page cache"
