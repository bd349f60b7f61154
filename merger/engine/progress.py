"""Bytes-written progress on rank 0: a live bar on a terminal, a line every 10% in logs."""
from __future__ import annotations

import sys
import time

from ..units import format_size


class Progress:
    def __init__(self, total: int, label: str = "writing", stream=None):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()
        self.next_line = 0.1

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        frac = min(self.done / self.total, 1.0)
        rate = self.done / max(time.monotonic() - self.start, 1e-6)
        text = (f"merger: {self.label} {frac:4.0%} {format_size(self.done)} / {format_size(self.total)} "
                f"({format_size(int(rate))}/s)")
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {text}" + ("\n" if frac >= 1 else ""))
            self.stream.flush()
        elif frac >= self.next_line or frac >= 1:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.next_line = int(frac * 10 + 1) / 10
