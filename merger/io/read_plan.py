"""The byte ranges a merge reads next, in its order, and the GETs that fetch ahead along them (object_store.py)."""
from __future__ import annotations

import bisect

BLOCK = 8 << 20  # bytes per ranged GET, at most
FETCH = 4 * BLOCK  # bytes one miss fetches, at most (GAP more where ranges are joined): 4 GETs of a block
SMALL = 64 << 10  # a read up to this size outside the plan fetches this much around it, not a block
GAP = 4 << 10  # ranges of one file this close together are one GET, the bytes between included (zip headers)


class Plan:
    """(key, start, end) ranges in the order they will be read. Each is fetched front to back as reads reach it:
    `done[i]` is how far range i has been fetched from its start."""

    def __init__(self, ranges: list[tuple[str, int, int]]):
        self.ranges = list(dict.fromkeys(r for r in ranges if r[2] > r[1]))  # a range read twice: fetched once
        self.done = [start for _, start, _ in self.ranges]
        by_key: dict[str, list[tuple[int, int]]] = {}
        for i, (key, start, _) in enumerate(self.ranges):
            by_key.setdefault(key, []).append((start, i))
        self.index = {key: ([s for s, _ in found], [i for _, i in found])
                      for key, found in ((k, sorted(v)) for k, v in by_key.items())}

    def _containing(self, key: str, at: int) -> int | None:
        starts, order = self.index.get(key, ((), ()))
        j = bisect.bisect_right(starts, at)
        for i in reversed(order[max(0, j - 4):j]):  # planned ranges may overlap: a few back suffice
            if at < self.ranges[i][2]:
                return i
        return None

    def after(self, key: str, at: int) -> list[tuple[str, int, int]] | None:
        """The GETs for a read that missed at byte `at` of `key`, FETCH bytes in all at most: its planned range
        from where that range's fetching stopped (`at` lies less than FETCH after it: a DCP blob's zip directory, at
        its end, is read before its data) and the ranges planned after it. None: `at` is in no planned range."""
        first = self._containing(key, at)
        if first is None:
            return None
        _, _, end = self.ranges[first]
        done = self.done[first]
        if not 0 <= at - done < FETCH:
            # Off the plan's course: bytes fetched before and pushed out (a piece read twice), or a blob larger than
            # FETCH read at its end first; its zip directory lies in the SMALL bytes before its end.
            start = at if at < done else max(done, at - SMALL)
            return _requests([(key, start, min(end, at + FETCH))])
        spans, total = [], 0  # total: each span counted with the GAP bytes that may join it to another
        for i in range(first, len(self.ranges)):
            k, _, end = self.ranges[i]
            take = min(end - self.done[i], FETCH - total)
            if take > 0:
                spans.append((k, self.done[i], self.done[i] + take))
                self.done[i] += take
                total += take + GAP
            if total >= FETCH:
                break
        return _requests(spans)


def _requests(spans: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """GETs of at most BLOCK bytes covering `spans`, those of one file GAP bytes apart or closer joined."""
    runs: list[list] = []
    for key, start, end in sorted(spans):
        if runs and runs[-1][0] == key and start - runs[-1][2] <= GAP:
            runs[-1][2] = max(runs[-1][2], end)
        else:
            runs.append([key, start, end])
    return [(key, a, min(a + BLOCK, end)) for key, start, end in runs for a in range(start, end, BLOCK)]
