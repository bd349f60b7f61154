"""A run of a tensor's elements in row-major order, as the boxes the plan speaks in.

Formats that flatten params into one vector per rank (DeepSpeed ZeRO) cut a param at any element: rank r holds
elements [begin, end) of it. Such a run is a partial row, whole rows, a partial row (recursively, per dim), so
it is a handful of boxes, each one contiguous run of the flat vector.
"""
from __future__ import annotations

import math


def run_boxes(shape: tuple[int, ...], begin: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of boxes covering elements [begin, end) of a row-major tensor of `shape`, in order."""
    if begin >= end:
        return []
    if not shape:
        return [((), ())]  # a 0-dim tensor: its one element
    inner = math.prod(shape[1:])
    first, last = begin // inner, (end - 1) // inner
    if first == last:  # within one row: recurse into it
        return [((first, *off), (1, *size)) for off, size in run_boxes(shape[1:], begin - first * inner,
                                                                       end - first * inner)]
    boxes = []
    whole_from, whole_to = first, last + 1
    if begin % inner:
        boxes += run_boxes(shape, begin, (first + 1) * inner)
        whole_from = first + 1
    if end % inner:
        whole_to = last
    if whole_to > whole_from:
        boxes.append(((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if end % inner:
        boxes += run_boxes(shape, last * inner, end)
    return boxes
