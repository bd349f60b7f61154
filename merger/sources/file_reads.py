"""Pieces copied out of source files at offsets, checked against the CRC-32 that torch.save records.

Readers say where a piece's elements lie (`Stored`); `SourceReads` copies them into the batch buffer, reading
through the storage that holds each file (merger/io: pread for local files, ranged GETs for objects). Nothing
of the source stays in the process's resident set.

torch.save files (verl FSDP rank files, DCP .distcp chunks, Megatron legacy .pt, legacy adapter .bin) record
a CRC-32 of every storage; it is computed over the bytes as they are copied, each piece's part separately
(pieces of one storage may come in any order), and compared once the storage has been read whole. Bytes no
piece reads (padding before or after the tensors in a storage) are read for the check alone.
Safetensors files record no checksum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..catalog import PieceCopy, PieceReader, ShardPiece, Stored, ZipRecord
from ..errors import CorruptSourceError, MergerError, SourceError
from ..io import reads_objects, storage_of
from ..io.local import LocalStorage, pread_into
from ..io.range_file import RangeFile
from .crc32 import CrcSpans, crc32

CHUNK = 1 << 20  # bytes per pread: small enough to stay in cache between the read, the checksum and the cast


def source_shrank(file: str, end: int) -> MergerError:
    """The error for a source file that ends before byte `end`, where data was when the merge began."""
    return MergerError(f"source file shrank while being read: it ends before byte {end}, where data was when "
                       f"the merge began (rewritten during the merge?), {file}")


class SourceFiles:
    """Source files read at offsets, each through the storage that holds it (merger/io)."""

    def __init__(self):
        self.local = LocalStorage(drop_cold=True)  # descriptors of its own, closed with it
        self.used: list = [self.local]

    def _storage(self, file: str):
        storage, key = storage_of(file)
        if isinstance(storage, LocalStorage):
            return self.local, key
        if storage not in self.used:
            self.used.append(storage)
        return storage, key

    def fd(self, file: str) -> int | None:
        """An open descriptor of a local file (for the kernel's copy); None for an object in a bucket."""
        storage, key = self._storage(file)
        try:
            return storage.local_fd(key)
        except FileNotFoundError as e:
            raise SourceError(f"source file is missing, {file}") from e

    def size(self, file: str) -> int:
        storage, key = self._storage(file)
        try:
            return storage.size(key)
        except FileNotFoundError as e:
            raise SourceError(f"source file is missing, {file}") from e

    def read_into(self, file: str, view: memoryview, offset: int) -> None:
        """Fill `view` with the file's bytes from `offset`; a file that ends first is an error."""
        storage, key = self._storage(file)
        try:
            got = storage.read_into(key, view, offset)
        except FileNotFoundError as e:
            raise SourceError(f"source file is missing, {file}") from e
        if got < len(view):
            raise source_shrank(file, offset + len(view))

    def will_read(self, ranges: list[tuple[str, int, int]]) -> None:
        """Tell the storages holding the files which (file, start, end) ranges are read next, in that order."""
        planned: dict = {storage: [] for storage in self.used}  # those not named: nothing planned any more
        for file, start, end in ranges:
            storage, key = self._storage(file)
            planned.setdefault(storage, []).append((key, start, end))
        for storage, found in planned.items():
            storage.will_read(found)

    def copied(self, file: str, start: int, end: int) -> None:
        """Bytes [start, end) of the local file `file` were copied out of it inside the kernel (a piece wanted as
        stored): read as the page cache sees them, so dropped with the rest of a cold file's (drop_read)."""
        self.local.was_read(self._storage(file)[1], start, end)

    def drop_read(self) -> None:
        """Drop from the page cache what was read of local files that were not cached (io/local.py)."""
        self.local.drop_read()

    def range_file(self, file: str, start: int, length: int) -> RangeFile:
        """Bytes [start, start + length) of the source file as a read-only file (zipfile reads a DCP blob)."""
        return RangeFile(lambda view, at: self.read_into(file, view, at), start, length)

    def close(self) -> None:
        for storage in self.used:
            storage.close()
        self.used.clear()


def geometry(dtype: torch.dtype, size, stride, offset: int, numel: int) -> torch.Tensor:
    """A data-less (meta) tensor with this geometry in a storage of `numel` elements, to describe a view."""
    return torch.empty(numel, dtype=dtype, device="meta").as_strided(size, stride, offset)


def _span_end(view: torch.Tensor) -> int:
    """The end (in bytes, from the storage's start) of the storage span a non-empty view covers."""
    extents = sum((n - 1) * st for n, st in zip(view.shape, view.stride()))
    return (view.storage_offset() + extents + 1) * view.element_size()


@dataclass(frozen=True)
class Placed:
    """Where a piece's bytes were copied to: the output file `file`, open as `fd` (readable), at (offset, bytes)
    per run, in the piece's order."""

    file: str
    fd: int
    runs: list[tuple[int, int]]


class _Check:
    """The CRC-32 of a record's bytes read so far (CrcSpans over the record)."""

    def __init__(self, file: str, record: ZipRecord, name: str):
        self.file, self.record, self.name = file, record, name
        self.read = CrcSpans()

    def add(self, begin: int, end: int, crc: int) -> None:
        self.read.add(begin, end, crc)  # a piece read twice: its first reading counts

    def gaps(self) -> list[tuple[int, int]]:
        return self.read.gaps(self.record.size)

    def complete(self) -> bool:
        return self.read.covered(0, self.record.size) is not None

    def verify(self) -> None:
        crc = self.read.covered(0, self.record.size)
        if crc != self.record.crc:
            raise CorruptSourceError(f"checksum mismatch in tensor {self.name}: the CRC-32 of zip record "
                                     f"{self.record.name} is {crc:08x} where the file records {self.record.crc:08x} "
                                     f"(damaged, or changed during the merge), {self.file}")


class SourceReads:
    """Copies pieces from source files into batch buffers, checking torch.save records as they complete."""

    def __init__(self):
        self.files = SourceFiles()
        self.scratch = torch.empty(CHUNK, dtype=torch.uint8)
        self.checks: dict[tuple[str, int], _Check | None] = {}  # None: verified

    def will_read(self, reader: PieceReader, pieces: Iterable[tuple[PieceCopy, ShardPiece, torch.dtype]]) -> None:
        """Say which byte ranges the next copies read, in their order (`pieces` as `reader.locate` takes them), to
        the storages that fetch ahead: objects in a bucket are then fetched in the merge's order, each byte about
        once. A piece whose format knows its byte range (a DCP blob, a safetensors tensor) gives it; the others
        are located. A merge of local files only returns at once, `pieces` untouched (a batch may hold millions)."""
        if not reads_objects():
            return
        ranges = []
        for copy, piece, dtype in pieces:
            if "://" not in copy.file:
                continue  # a local path (storage_of's test): the kernel reads ahead in it, nothing to locate
            if copy.byte_range is not None:
                start, length = copy.byte_range
                ranges.append((copy.file, start, start + length))
                continue
            stored = reader.locate(copy, piece, dtype)
            if stored.start is not None and stored.view.numel() > 0:
                first = stored.view.storage_offset() * stored.view.element_size()
                ranges.append((copy.file, stored.start + first, stored.start + _span_end(stored.view)))
        self.files.will_read(ranges)

    def copy(self, stored: Stored, out: torch.Tensor, name: str) -> None:
        """Copy (casting to `out`'s dtype) the piece into `out`, a contiguous tensor of its shape."""
        view = stored.view
        if stored.start is None:
            out.copy_(view)
            return
        if view.numel() == 0:
            return
        size = view.element_size()
        first = view.storage_offset() * size
        if view.is_contiguous():
            end, crc = self._copy_run(stored, first, out.view(-1))
        else:
            end, crc = self._copy_strided(stored, first, out)
        if stored.record is not None:
            self._record(stored, first, end, crc, name)

    def copy_unchanged(self, stored: Stored, name: str, place: Callable[[int, int, str], Placed | None]) -> bool:
        """Have `place(fd, at, file)` copy the piece, contiguous in its source file and wanted exactly as stored,
        from byte `at` of the open file `fd` into the output (FileSink.copy_part, inside the kernel), then check
        the bytes against the storage's torch.save record by reading them back where they went: what is checked
        is what was written. False when nothing was copied: the piece must then be read with `copy`."""
        view = stored.view
        if stored.start is None or view.numel() == 0 or not view.is_contiguous():
            return False
        first = view.storage_offset() * view.element_size()
        end = first + view.numel() * view.element_size()
        fd = self.files.fd(stored.file)
        if fd is None:
            return False  # an object in a bucket: no kernel copy from it
        placed = place(fd, stored.start + first, stored.file)
        if placed is None:
            return False
        self.files.copied(stored.file, stored.start + first, stored.start + end)
        if stored.record is not None:
            def read_back(part: memoryview, at: int) -> None:
                if pread_into(placed.fd, part, at) < len(part):
                    raise MergerError(f"the merged model's file ends before byte {at + len(part)}, where tensor "
                                      f"{name} was just copied (truncated by another process?), {placed.file}")

            crc = 0
            for at, size in placed.runs:
                crc = self._crc_in_chunks(read_back, at, at + size, crc)
            self._record(stored, first, end, crc, name)
        return True

    def verify(self, stored: Stored, name: str) -> int:
        """Check the piece's bytes without copying them (`inspect --check`): its torch.save record is read whole
        and its CRC-32 compared, as a merge would; bytes no format checksums (safetensors) must lie within the
        file. The bytes read or bounded: a record counts once, however many pieces view it."""
        view = stored.view
        if stored.start is None or view.numel() == 0:
            return 0  # loaded whole (a pre-zip torch file, which loading checked), or nothing to read
        if stored.record is None:
            end = stored.start + _span_end(view)
            size = self.files.size(stored.file)
            if end > size:
                raise CorruptSourceError(f"tensor {name} ends at byte {end}, past the end of the file ({size} bytes; "
                                         f"truncated?), {stored.file}")
            return view.numel() * view.element_size()
        key = (stored.file, stored.start)
        if key in self.checks:
            return 0
        check = self.checks[key] = _Check(stored.file, stored.record, name)
        self._fill(check, 0, stored.record.size)
        check.verify()
        self.checks[key] = None
        return stored.record.size

    def _copy_run(self, stored: Stored, first: int, flat: torch.Tensor) -> tuple[int, int]:
        """Copy a contiguous run of elements from byte `first` of the storage; (end byte, CRC-32 of the run)."""
        dtype = stored.view.dtype
        end = first + flat.numel() * dtype.itemsize
        if flat.dtype == dtype:  # no cast: straight into the batch buffer
            return end, self._read(stored, first, flat.view(torch.uint8))
        crc, step = 0, CHUNK // dtype.itemsize
        for lo in range(0, flat.numel(), step):
            hi = min(lo + step, flat.numel())
            part = self.scratch[:(hi - lo) * dtype.itemsize]
            crc = self._read(stored, first + lo * dtype.itemsize, part, crc)
            flat[lo:hi].copy_(part.view(dtype))
        return end, crc

    def _copy_strided(self, stored: Stored, first: int, out: torch.Tensor) -> tuple[int, int]:
        """Copy a strided view (a column block, a transposed GroupedMLP expert) into `out`: the span of the storage
        it covers is read front to back in bands of whole steps along its largest stride, each band's elements
        picked out while the band is in cache; (end byte of the span, CRC-32 of the span).

        Bands of about CHUNK bytes (one step at least), in the scratch buffer: a buffer the size of the span, new
        for every piece, cost its page faults, and its first elements had left the cache by the time they were
        picked (the 2.41 GiB Megatron MoE benchmark checkpoint, experts transposed: 9.56 s against 10.14 s, medians
        of 4 alternating runs). A view whose other dims reach past one step of the largest stride (no layout a
        reader makes) is read as one band."""
        view = stored.view
        size = view.element_size()
        extents = [(n - 1) * st for n, st in zip(view.shape, view.stride())]
        end = _span_end(view)
        outer = max(range(view.dim()), key=lambda d: view.stride(d) if view.shape[d] > 1 else -1)
        count, step = view.shape[outer], view.stride(outer) * size  # steps along `outer`, bytes per step
        interleaved = (sum(extents) - extents[outer]) * size >= step
        rows = count if interleaved else max(1, CHUNK // step)
        band_bytes = min(rows * step, end - first)
        buffer = self.scratch if band_bytes <= CHUNK else torch.empty(band_bytes, dtype=torch.uint8)
        crc, at = 0, first
        for lo in range(0, count, rows):
            n = min(rows, count - lo)
            stop = end if lo + n == count else at + n * step
            band = buffer[:stop - at]
            crc = self._read(stored, at, band, crc)
            shape = (*view.shape[:outer], n, *view.shape[outer + 1:])
            out.narrow(outer, lo, n).copy_(band.view(view.dtype).as_strided(shape, view.stride(), 0))
            at = stop
        return end, crc

    def _read(self, stored: Stored, at: int, dest: torch.Tensor, crc: int = 0) -> int:
        """Bytes [at, at + len) of the storage into the uint8 tensor `dest`; returns their CRC-32 continuing `crc`
        (0 when the storage has no record), computed chunk by chunk while the bytes are in cache."""
        view = memoryview(dest.numpy())
        for lo in range(0, len(view), CHUNK):
            part = view[lo:lo + CHUNK]
            self.files.read_into(stored.file, part, stored.start + at + lo)
            if stored.record is not None:
                crc = crc32(part, crc)
        return crc

    def _record(self, stored: Stored, begin: int, end: int, crc: int, name: str) -> None:
        """Count bytes [begin, end) of the storage's record as read; read what only padding leaves unread, and
        verify the record once it is read whole."""
        key = (stored.file, stored.start)
        if key not in self.checks:
            self.checks[key] = _Check(stored.file, stored.record, name)
        check = self.checks[key]
        if check is None:
            return  # verified already: a piece read twice adds nothing
        check.add(begin, end, crc)
        used_begin, used_end = stored.record.used
        for gap in check.gaps():
            if gap[1] <= used_begin or gap[0] >= used_end:
                self._fill(check, *gap)
        if check.complete():
            check.name = name
            check.verify()
            self.checks[key] = None

    def _fill(self, check: _Check, begin: int, end: int) -> None:
        read = lambda part, at: self.files.read_into(check.file, part, check.record.start + at)  # noqa: E731
        check.add(begin, end, self._crc_in_chunks(read, begin, end))

    def _crc_in_chunks(self, read: Callable[[memoryview, int], None], begin: int, end: int, crc: int = 0) -> int:
        """The CRC-32 of bytes [begin, end), continuing `crc`, as `read(part, at)` puts them into the scratch
        buffer chunk by chunk (`part` to be filled with the bytes from `at`)."""
        scratch = memoryview(self.scratch.numpy())
        for lo in range(begin, end, CHUNK):
            part = scratch[:min(CHUNK, end - lo)]
            read(part, lo)
            crc = crc32(part, crc)
        return crc

    def finish(self) -> None:
        """Check the records that were read only in part (a storage shared with a tensor that is not merged)."""
        for key, check in self.checks.items():
            if check is not None:
                for gap in check.gaps():
                    self._fill(check, *gap)
                check.verify()
                self.checks[key] = None

    def batch_read(self) -> None:
        """A batch is read: what it read of local files that were not cached leaves the page cache."""
        self.files.drop_read()

    def close(self) -> None:
        self.files.close()

