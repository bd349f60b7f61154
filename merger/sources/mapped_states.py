"""Source files, each mapped once (a torch.load(mmap=True) state dict, or the file itself), and the pages
reads touched handed back.

A mapping covers a whole file; a read touches only its tensor's pages. Readers `touch` what
they read from a mapped file, and `release` gives those pages back to the kernel (memory.release_pages), so
resident memory stays at about one piece however large the files. Only mapped tensors may be touched:
on ordinary heap memory MADV_DONTNEED would discard the data.
"""
from __future__ import annotations

import mmap
from typing import Callable

import torch

from ..errors import MergerError
from ..memory import release_pages


def map_file(file: str) -> mmap.mmap:
    """A private read mapping of a whole source file (writable memory for torch.frombuffer; never written)."""
    try:
        with open(file, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError as e:
        raise MergerError(f"source file is missing, {file}") from e
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise MergerError(f"cannot map the source file ({e}), {file}") from e


class MappedStates:
    def __init__(self, load: Callable[[str], dict]):
        self.load = load
        self.states: dict[str, dict] = {}
        self.touched: list[torch.Tensor] = []

    def __getitem__(self, file: str) -> dict:
        if file not in self.states:
            self.states[file] = self.load(file)
        return self.states[file]

    def bytes_at(self, file: str, offset: int, length: int) -> torch.Tensor:
        """Bytes [offset, offset + length) of a mapped file, in place, as a uint8 tensor (touched)."""
        mapped = self[file]
        if offset + length > len(mapped):
            raise MergerError(f"data at bytes {offset}..{offset + length} runs past the end of the file "
                              f"({len(mapped)} bytes; truncated?), {file}")
        if not length:
            return torch.empty(0, dtype=torch.uint8)
        view = torch.frombuffer(mapped, dtype=torch.uint8, count=length, offset=offset)
        self.touch(view)
        return view

    def touch(self, tensor: torch.Tensor) -> None:
        self.touched.append(tensor)

    def release(self) -> None:
        for t in self.touched:
            release_pages(t)
        self.touched.clear()
