"""A piece's locator may name a sub-box of a stored tensor along dim 0: `name`, `name[a:b]` or `name[i]`.

Legacy gated fc1 files hold [gate_r; up_r] per TP rank: each half is its own piece (`[0:f]`, `[f:2f]`).
torch_dist stacks layers on axis 0: one layer of a stored chunk is `[i]` (that axis dropped).
"""
from __future__ import annotations

import re

import torch

_SLICE = re.compile(r"(.*)\[(\d+)(?::(\d+))?\]")


def with_slice(name: str, start: int, stop: int | None = None) -> str:
    return f"{name}[{start}]" if stop is None else f"{name}[{start}:{stop}]"


def split_key(key: str) -> tuple[str, tuple[int, int | None] | None]:
    m = _SLICE.fullmatch(key)
    if not m:
        return key, None
    return m.group(1), (int(m.group(2)), int(m.group(3)) if m.group(3) is not None else None)


def take(tensor: torch.Tensor, sl: tuple[int, int | None] | None) -> torch.Tensor:
    if sl is None:
        return tensor
    start, stop = sl
    return tensor[start] if stop is None else tensor[start:stop]
