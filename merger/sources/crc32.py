"""CRC-32 (the zip polynomial) of the bytes merger reads, and of a concatenation from the CRCs of its parts.

`crc32` is on the read path of every torch.save source and the write path of every output block: it is ISA-L's
(the `isal` package, a dependency wherever it has wheels), which folds with carry-less multiplies: 11 GB/s a core
on this project's machine, where zlib's took 3.0, and the CPython of the lent GPU machine's image 1.9 (its CRC
then took a 1-rank merge's main thread 2.3 of its 3.3 s; benchmarks.md). Both compute the same function, release
the GIL while they run, and take any buffer, read-only ones too.

`crc32_combine` is zlib's crc32_combine, which Python's zlib does not expose. Pieces of one torch.save record
may be read out of order, in different batches, and an output block is written piece by piece by several ranks;
combining their CRCs (`CrcSpans`) checks the record, or checksums the block, without reading any byte twice.
CRCs are polynomials over GF(2) in reflected bit order: appending `n` bytes to a message multiplies its CRC by x^(8n) modulo the polynomial before the CRC of the appended bytes is added (XORed).
"""
from __future__ import annotations

import bisect

try:
    from isal import isal_zlib as _crc_library
except ImportError:  # a platform isal has no wheel for (pyproject's marker): zlib's, the same function, slower
    import zlib as _crc_library

crc32 = _crc_library.crc32  # crc32(data, crc=0) -> the CRC-32 of data, continuing crc

_POLY = 0xEDB88320  # reflected x^32 + x^26 + ... + 1
_ONE = 1 << 31  # the polynomial 1, reflected


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial (both reflected)."""
    product = 0
    for _ in range(32):
        if a & _ONE:
            product ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial for k = 0..63."""
    powers = [_ONE >> 1]  # x
    for _ in range(63):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_TO_2K = _powers()


def _x_to_8n(n: int) -> int:
    """x^(8n) modulo the polynomial."""
    result, k = _ONE, 3  # 8n = n * 2^3
    while n:
        if n & 1:
            result = _multiply(_X_TO_2K[k], result)
        n >>= 1
        k += 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B)."""
    return _multiply(_x_to_8n(len2), crc1) ^ crc2


class CrcSpans:
    """The CRC-32 of the bytes of a range seen so far, from the CRCs of its pieces in any order: disjoint
    [begin, end, crc] spans, sorted, adjacent ones combined into one."""

    def __init__(self):
        self.spans: list[list[int]] = []

    def add(self, begin: int, end: int, crc: int) -> None:
        """Bytes [begin, end) have CRC `crc`. A piece overlapping bytes seen before is dropped: the first counts."""
        i = bisect.bisect_right(self.spans, begin, key=lambda span: span[1] - 1)  # the first span ending past begin
        if i < len(self.spans) and self.spans[i][0] < end:
            return
        self.spans.insert(i, [begin, end, crc])
        if i + 1 < len(self.spans) and self.spans[i + 1][0] == end:
            nxt = self.spans.pop(i + 1)
            self.spans[i][1:] = [nxt[1], crc32_combine(self.spans[i][2], nxt[2], nxt[1] - nxt[0])]
        if i > 0 and self.spans[i - 1][1] == begin:
            cur = self.spans.pop(i)
            self.spans[i - 1][1:] = [cur[1], crc32_combine(self.spans[i - 1][2], cur[2], cur[1] - cur[0])]

    def gaps(self, size: int) -> list[tuple[int, int]]:
        """The ranges of [0, size) no piece has covered yet."""
        gaps, at = [], 0
        for begin, end, _ in self.spans:
            if begin > at:
                gaps.append((at, begin))
            at = end
        if at < size:
            gaps.append((at, size))
        return gaps

    def covered(self, begin: int, end: int) -> int | None:
        """The CRC-32 of bytes [begin, end) when one span is exactly that range (0 for an empty one), else None."""
        if begin == end:
            return 0 if not self.spans else None
        return self.spans[0][2] if len(self.spans) == 1 and self.spans[0][:2] == [begin, end] else None
