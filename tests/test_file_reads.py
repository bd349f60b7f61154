"""Pieces read with pread out of torch.save files and checked against the zip's CRC-32s, against torch.load and zlib.

Files are written by torch.save and located through torch.load(mmap=True) as merger's readers do; pieces of one
storage are read in any order, and damage anywhere in a storage (tensor bytes or padding) must fail its check.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merger.errors import CorruptSourceError, MergerError
from merger.sources.safe_load import torch_load
from merger.sources.crc32 import crc32, crc32_combine
from merger.sources.file_reads import SourceReads
from merger.sources.mapped_states import MappedStates


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32_combine_equals_zlib_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_crc32_equals_zlib(data, start):
    """The read path's CRC-32 (ISA-L's where isal is installed) is zlib's, continued from any value, of writable
    and read-only buffers alike."""
    assert crc32(memoryview(bytearray(data)), start) == zlib.crc32(data, start)
    assert crc32(data, start) == zlib.crc32(data, start)


def _pieces(states: MappedStates, file: str, name: str, rows: list[tuple[int, int]]):
    return [states.stored(file, states[file][name][lo:hi]) for lo, hi in rows]


def _save(tmp_path: Path) -> tuple[str, dict]:
    state = {"w": torch.randn(12, 5), "padded": torch.arange(40, dtype=torch.float32)[4:30].reshape(13, 2)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return str(path), state


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_pieces_in_any_order_equal_torch_load_and_are_checked(tmp_path, order):
    file, state = _save(tmp_path)
    states, reads = MappedStates(lambda f: torch_load(f, "test file")), SourceReads()
    rows = [(0, 5), (5, 9), (9, 12)]
    pieces = _pieces(states, file, "w", rows)
    for i in order:
        out = torch.empty(rows[i][1] - rows[i][0], 5, dtype=torch.bfloat16)
        reads.copy(pieces[i], out, "w")
        assert torch.equal(out, state["w"][rows[i][0]:rows[i][1]].to(torch.bfloat16))
    assert all(check is None for check in reads.checks.values())  # verified as the last piece came in
    reads.close()


@pytest.mark.parametrize("where", ["tensor start", "tensor end", "padding before", "padding after"])
def test_a_flipped_bit_anywhere_in_the_storage_fails(tmp_path, where):
    file, state = _save(tmp_path)
    states = MappedStates(lambda f: torch_load(f, "test file"))
    whole = torch.arange(40, dtype=torch.float32).numpy().tobytes()
    data = bytearray(Path(file).read_bytes())
    start = data.find(whole)  # the storage of `padded`, found by content
    at = {"tensor start": 4 * 4 + 1, "tensor end": 4 * 29, "padding before": 2, "padding after": 4 * 35}[where]
    data[start + at] ^= 0x01
    Path(file).write_bytes(data)
    reads = SourceReads()
    pieces = _pieces(states, file, "padded", [(7, 13), (0, 7)])
    reads.copy(pieces[0], torch.empty(6, 2), "padded")
    with pytest.raises(MergerError, match=f"checksum mismatch in tensor padded: the CRC-32 of zip record data/1 .*, "
                                          f"{file}$"):
        reads.copy(pieces[1], torch.empty(7, 2), "padded")
    reads.close()


def test_part_of_a_storage_left_unread_is_checked_at_the_end(tmp_path):
    file, _ = _save(tmp_path)
    states, reads = MappedStates(lambda f: torch_load(f, "test file")), SourceReads()
    reads.copy(_pieces(states, file, "w", [(0, 5)])[0], torch.empty(5, 5), "w")
    assert any(check is not None for check in reads.checks.values())
    data = bytearray(Path(file).read_bytes())
    data[data.find(torch.load(file)["w"][6:].numpy().tobytes())] ^= 0x01  # a byte no piece read
    Path(file).write_bytes(data)
    with pytest.raises(CorruptSourceError):
        reads.finish()
    reads.close()


def test_a_file_that_shrank_is_a_clear_error(tmp_path):
    file, _ = _save(tmp_path)
    states, reads = MappedStates(lambda f: torch_load(f, "test file")), SourceReads()
    piece = _pieces(states, file, "w", [(0, 12)])[0]
    Path(file).write_bytes(Path(file).read_bytes()[:piece.start + 8])
    with pytest.raises(MergerError, match=f"source file shrank while being read.*rewritten during the merge.*, {file}$"):
        reads.copy(piece, torch.empty(12, 5), "w")
    reads.close()


# Strided views as the readers make them, over storages larger than the 1 MiB band the reader picks them from.
STRIDED = {
    "GroupedMLP expert, transposed": ((4 * 600, 700), lambda t: t.view(4, 600, 700)[2].t()),
    "column block": ((900, 800), lambda t: t[:, 100:500]),
    "column block of rows wider than a band": ((3, 300_000), lambda t: t[:, 1000:1100]),
    "permuted 3-D block": ((40, 50, 60), lambda t: t.permute(2, 0, 1)[5:20]),
    "every other element": ((700_000,), lambda t: t[1::2]),
    "transposed rows": ((1000, 600), lambda t: t.t()[100:300]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(STRIDED))
def test_strided_views_equal_torch_indexing_and_are_checked(tmp_path, case, dtype):
    shape, view_of = STRIDED[case]
    base = torch.randn(shape)
    torch.save({"t": base}, tmp_path / "state.pt")
    file = str(tmp_path / "state.pt")
    states, reads = MappedStates(lambda f: torch_load(f, "test file")), SourceReads()
    piece = states.stored(file, view_of(states[file]["t"]))
    assert not piece.view.is_contiguous()
    out = torch.empty(piece.view.shape, dtype=dtype)
    reads.copy(piece, out, "t")
    assert torch.equal(out, view_of(base).to(dtype))  # the oracle: torch's own indexing of the loaded tensor
    reads.finish()  # the rest of the storage read for the check: it passes
    reads.close()


def test_a_flipped_bit_inside_a_strided_span_fails(tmp_path):
    shape, view_of = STRIDED["GroupedMLP expert, transposed"]
    base = torch.randn(shape)
    torch.save({"t": base}, tmp_path / "state.pt")
    file = tmp_path / "state.pt"
    data = bytearray(file.read_bytes())
    data[data.find(base[2 * 600 + 400].numpy().tobytes()) + 5] ^= 0x10  # in the expert's span, past its first band
    file.write_bytes(data)
    states, reads = MappedStates(lambda f: torch_load(f, "test file")), SourceReads()
    piece = states.stored(str(file), view_of(states[str(file)]["t"]))
    reads.copy(piece, torch.empty(piece.view.shape), "t")
    with pytest.raises(CorruptSourceError):
        reads.finish()
    reads.close()
