"""Bytes-written progress on rank 0: a live bar on a terminal, a line every 10% in logs; shown where merger's INFO
lines are (`shown`)."""
from __future__ import annotations

import logging
import sys
import time

from ..units import format_size


def shown() -> bool:
    """Whether to show progress: it is one of merger's INFO lines, shown where something handles those. The command
    line configures logging; merger called as a library inside a trainer says nothing unless the trainer's logging
    asks for merger's INFO."""
    log = logging.getLogger("merger")
    return log.isEnabledFor(logging.INFO) and log.hasHandlers()


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
