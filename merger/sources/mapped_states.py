"""State dicts of torch.save files, each loaded once (memory-mapped), and the pages reads touched handed back.

torch.load(mmap=True) maps a whole rank file; a read touches only its tensor's pages. Readers `touch` what
they read from a mapped file, and `release` gives those pages back to the kernel (memory.release_pages), so
resident memory stays at about one piece however large the files. Only mapped tensors may be touched:
on ordinary heap memory MADV_DONTNEED would discard the data.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..memory import release_pages


class MappedStates:
    def __init__(self, load: Callable[[str], dict]):
        self.load = load
        self.states: dict[str, dict] = {}
        self.touched: list[torch.Tensor] = []

    def __getitem__(self, file: str) -> dict:
        if file not in self.states:
            self.states[file] = self.load(file)
        return self.states[file]

    def touch(self, tensor: torch.Tensor) -> None:
        self.touched.append(tensor)

    def release(self) -> None:
        for t in self.touched:
            release_pages(t)
        self.touched.clear()
