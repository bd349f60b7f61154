"""The CRC-32 of an output block from the CRCs its writers took as they wrote (output/written_crcs.py), combined
out of order by the block's rank (sources/crc32.CrcSpans): equal to zlib's CRC-32 of the block's bytes, or
no CRC at all (the block is then read back), never a wrong one."""
from __future__ import annotations

import random
import zlib

import pytest

from merger.output import written_crcs
from merger.output.written_crcs import WrittenCrcs
from merger.sources.crc32 import CrcSpans

pytestmark = pytest.mark.unit

BLOCK = 4096


def _pieces(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """[start, end) pieces that tile [0, size): from a few bytes to several blocks, most crossing no edge."""
    cuts = sorted(rng.sample(range(1, size), 60))
    return list(zip([0, *cuts], [*cuts, size]))


def _combine(writers: list[WrittenCrcs]) -> dict[tuple[int, int], CrcSpans]:
    """Each block's records from every writer, in a shuffled order (ranks' records reach a block's rank at
    different sync points)."""
    records = [r for w in writers for r in w.take()]
    random.Random(1).shuffle(records)
    blocks: dict[tuple[int, int], CrcSpans] = {}
    for index, start, end, crc in records:
        assert start // BLOCK == (end - 1) // BLOCK  # no record crosses a block's edge
        blocks.setdefault((index, start // BLOCK), CrcSpans()).add(start, end, crc)
    return blocks


@pytest.mark.parametrize("ranks", [1, 3])
def test_block_crcs_from_pieces_written_by_several_ranks_in_any_order(ranks):
    """Two files written piece by piece, the pieces dealt at random over `ranks` writers and written in a
    random order: every block's combined CRC is zlib's over the block's bytes."""
    rng = random.Random(ranks)
    files = {0: rng.randbytes(10 * BLOCK + 123), 1: rng.randbytes(3 * BLOCK)}
    writers = [WrittenCrcs(frozenset(files), BLOCK) for _ in range(ranks)]
    work = [(index, piece) for index, data in files.items() for piece in _pieces(len(data), rng)]
    rng.shuffle(work)
    for index, (start, end) in sorted(work[:len(work) // 2], key=lambda w: w[1]) + work[len(work) // 2:]:
        rank = rng.randrange(ranks)  # the first half in file order (long contiguous stretches), the rest shuffled
        writers[rank].add(index, memoryview(bytearray(files[index][start:end])), start)
    blocks = _combine(writers)
    for index, data in files.items():
        for k in range(-(-len(data) // BLOCK)):
            start, end = k * BLOCK, min((k + 1) * BLOCK, len(data))
            assert blocks[(index, k)].covered(start, end) == zlib.crc32(data[start:end]), (index, k)


def test_a_block_with_bytes_no_crc_was_taken_of_has_none():
    """A writer that skips some bytes (copied inside the kernel) or makes more than MOST_PER_BLOCK records in a
    block leaves that block without a CRC; the other blocks keep theirs."""
    rng = random.Random(7)
    data = rng.randbytes(4 * BLOCK)
    writer = WrittenCrcs(frozenset({0}), BLOCK)
    writer.add(0, memoryview(bytearray(data[:BLOCK - 10])), 0)  # block 0: its last 10 bytes never recorded
    every_other = list(range(BLOCK, 2 * BLOCK, 2))  # block 1: one record per byte, too many
    for at in every_other + [at + 1 for at in every_other]:
        writer.add(0, memoryview(bytearray(data[at:at + 1])), at)
    writer.add(0, memoryview(bytearray(data[2 * BLOCK:])), 2 * BLOCK)  # blocks 2 and 3: whole
    blocks = _combine([writer])
    assert written_crcs.MOST_PER_BLOCK < BLOCK
    assert blocks[(0, 0)].covered(0, BLOCK) is None and blocks[(0, 0)].gaps(BLOCK) == [(BLOCK - 10, BLOCK)]
    assert blocks[(0, 1)].covered(BLOCK, 2 * BLOCK) is None
    for k in (2, 3):
        assert blocks[(0, k)].covered(k * BLOCK, (k + 1) * BLOCK) == zlib.crc32(data[k * BLOCK:(k + 1) * BLOCK])


def test_only_the_files_asked_for_are_recorded():
    writer = WrittenCrcs(frozenset({1}), BLOCK)
    writer.add(0, memoryview(bytearray(b"x" * 100)), 0)
    writer.add(1, memoryview(bytearray(b"y" * 100)), 0)
    assert writer.take() == [(1, 0, 100, zlib.crc32(b"y" * 100))]
