"""A piece's locator may name a sub-box of a stored tensor: `name`, `name[a:b]`, `name[i,j,...]`, and in a
legacy file `name{ExRxC:e}` or `name{ExRxC:e}[a:b]`.

`[a:b]` narrows dim 0: legacy gated fc1 files hold [gate_r; up_r] per TP rank, each half its own piece.
`[i,j]` selects along the leading dims, dropping them: torch_dist stacks layers (and SequentialMLP
experts) on leading axes, torchtitan stacks a MoE layer's experts (sources/unstacked.py), and one layer's
(expert's) part of a stored chunk is one such selection.
`{ExRxC:e}` is expert e of a GroupedMLP matrix (`experts.weight1` [H, E·2F], `weight2` [E·F, H]): its memory
viewed as [E, R, C] holds each local expert's weight as the grouped GEMM multiplies by it, [in, out], so
expert e is `view(E, R, C)[e].T` in a Linear's [out, in] layout. That is a raw memory view, not a column
block: weight1[:, :2F] would mix experts. The transposed block is a strided view of one contiguous run of
the file, which the stream reads as it reads any strided piece (sources/file_reads.py), so the catalog
presents every expert as the per-expert tensor SequentialMLP saves and no mapping step has to transpose.
"""
from __future__ import annotations

import re

import torch

_SLICE = re.compile(r"(.*)\[(\d+:\d+|\d+(?:,\d+)*)\]")
_EXPERT = re.compile(r"(.*)\{(\d+)x(\d+)x(\d+):(\d+)\}")


def with_slice(name: str, start: int, stop: int) -> str:
    return f"{name}[{start}:{stop}]"


def with_index(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{','.join(map(str, index))}]" if index else name


def with_expert(name: str, view: tuple[int, int, int], expert: int) -> str:
    return f"{name}{{{'x'.join(map(str, view))}:{expert}}}"


def split_key(key: str) -> tuple[str, slice | tuple[int, ...] | None]:
    m = _SLICE.fullmatch(key)
    if not m:
        return key, None
    text = m.group(2)
    if ":" in text:
        start, stop = (int(x) for x in text.split(":"))
        return m.group(1), slice(start, stop)
    return m.group(1), tuple(int(x) for x in text.split(","))


def split_expert(key: str) -> tuple[str, tuple[tuple[int, int, int], int] | None]:
    m = _EXPERT.fullmatch(key)
    if not m:
        return key, None
    e, r, c, expert = (int(m.group(i)) for i in range(2, 6))
    return m.group(1), ((e, r, c), expert)


def take(tensor: torch.Tensor, sl: slice | tuple[int, ...] | None) -> torch.Tensor:
    return tensor if sl is None else tensor[sl]


def take_expert(tensor: torch.Tensor, grouped: tuple[tuple[int, int, int], int] | None) -> torch.Tensor:
    if grouped is None:
        return tensor
    view, expert = grouped
    return tensor.view(view)[expert].t()
