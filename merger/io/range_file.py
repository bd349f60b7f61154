"""Bytes [start, start + length) of a file as a read-only file object, for readers that want one (zipfile reads a
torch.save zip's directory through it), each read a `read(view, offset)` that fills the view or raises."""
from __future__ import annotations

import io
from typing import Callable


class RangeFile(io.RawIOBase):
    def __init__(self, read: Callable[[memoryview, int], None], start: int, length: int):
        self.read_at, self.start, self.length, self.pos = read, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.length)[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.read_at(memoryview(buffer).cast("B")[:n], self.start + self.pos)
        self.pos += n
        return n
