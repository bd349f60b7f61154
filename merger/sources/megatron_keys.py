"""A piece's locator may name a sub-box of a stored tensor: `name`, `name[a:b]` or `name[i,j,...]`.

`[a:b]` narrows dim 0: legacy gated fc1 files hold [gate_r; up_r] per TP rank, each half its own piece.
`[i,j]` selects along the leading dims, dropping them: torch_dist stacks layers (and SequentialMLP
experts) on leading axes, and one layer's (expert's) part of a stored chunk is one such selection.
"""
from __future__ import annotations

import re

import torch

_SLICE = re.compile(r"(.*)\[(\d+:\d+|\d+(?:,\d+)*)\]")


def with_slice(name: str, start: int, stop: int) -> str:
    return f"{name}[{start}:{stop}]"


def with_index(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{','.join(map(str, index))}]" if index else name


def split_key(key: str) -> tuple[str, slice | tuple[int, ...] | None]:
    m = _SLICE.fullmatch(key)
    if not m:
        return key, None
    text = m.group(2)
    if ":" in text:
        start, stop = (int(x) for x in text.split(":"))
        return m.group(1), slice(start, stop)
    return m.group(1), tuple(int(x) for x in text.split(","))


def take(tensor: torch.Tensor, sl: slice | tuple[int, ...] | None) -> torch.Tensor:
    return tensor if sl is None else tensor[sl]
