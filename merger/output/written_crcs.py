"""The CRC-32 of the bytes a rank writes, taken as it writes them, so that the output's block checksums need
no read of what was written (resume.py).

A run that starts where the last run into the same file ended continues that run's CRC (zlib's crc32 takes
the CRC so far), so a rank writing whole tensors one after another, or its rows of each, makes one record per
stretch of contiguous bytes, however small its tensors. A record never crosses a checksum block's edge: each
block's records go to the rank that checksums it, which combines them (CrcSpans).
"""
from __future__ import annotations

from collections import Counter

from ..sources.crc32 import crc32

# Records one rank makes in one block, past which it makes no more there: the block is read back instead.
# Splitting a tensor's columns among ranks makes a run per row, and the records of millions of few-KiB runs
# would cost more to send and combine than one read of the block.
MOST_PER_BLOCK = 1024


class WrittenCrcs:
    """(file index, start, end, CRC-32) of the stretches of bytes written into `files`, each inside one block of
    `block` bytes. Used by one thread at a time: the sink's writer, and the tracker between batches."""

    def __init__(self, files: frozenset[int], block: int):
        self.files, self.block = files, block
        self.open: dict[int, list[int]] = {}  # file index -> [start, end, crc] of the stretch still growing
        self.made: Counter[tuple[int, int]] = Counter()  # (file index, block) -> records made there
        self.records: list[tuple[int, int, int, int]] = []

    def add(self, index: int, data: memoryview, at: int) -> None:
        """`data` was written at byte `at` of file `index`."""
        if index not in self.files:
            return
        while len(data):
            n = min(len(data), self.block - at % self.block)
            stretch = self.open.get(index)
            if stretch is not None and stretch[1] == at and at % self.block:
                stretch[1:] = [at + n, crc32(data[:n], stretch[2])]
            else:
                self._close(index)
                self.open[index] = [at, at + n, crc32(data[:n])]
            data, at = data[n:], at + n

    def _close(self, index: int) -> None:
        stretch = self.open.pop(index, None)
        if stretch is None:
            return
        block = (index, stretch[0] // self.block)
        self.made[block] += 1
        if self.made[block] <= MOST_PER_BLOCK:
            self.records.append((index, *stretch[:2], stretch[2]))

    def take(self) -> list[tuple[int, int, int, int]]:
        """The records made since the last take, each as (file index, start, end, CRC-32), the growing
        stretches closed."""
        for index in list(self.open):
            self._close(index)
        records, self.records = self.records, []
        return records
