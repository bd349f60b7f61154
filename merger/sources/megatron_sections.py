"""Megatron tensors that fuse named sections per TP rank: Gated DeltaNet's (megatron-core ssm/gated_delta_net.py).

GatedDeltaNet's column-parallel `in_proj` holds, on each TP rank, that rank's [query key value z beta alpha] rows
one after another, and its depthwise `conv1d` that rank's [query key value] channels. torch_dist saves each
section as a tensor of its own (`in_proj.weight.query`, ...: megatron-core's `_split_tensor_factory`); a legacy
rank file holds the rank's fused tensor. Both catalogs present the one global tensor whose sections follow one
another whole ([q; k; v; z; b; a], conv1d [q; k; v]), as a gated fc1 is presented cat(gate, up): the mapping
then reads the same tensor from either format.
"""
from __future__ import annotations

from typing import Callable

from ..catalog import ShardPiece
from ..errors import MergerError

IN_PROJ = "self_attention.in_proj.weight"
CONV = ("self_attention.conv1d.weight", "self_attention.conv1d.bias")
SECTIONS = {IN_PROJ: ("query", "key", "value", "z", "beta", "alpha")} | {
    name: ("query", "key", "value") for name in CONV}


def _fused(name: str) -> str | None:
    """The SECTIONS key that `name` (a whole tensor's name) ends with, or None."""
    return next((key for key in SECTIONS if name.endswith("." + key)), None)


def local_sections(name: str, shape_of: Callable[[str], tuple[int, ...] | None], where: str
                   ) -> tuple[int, ...] | None:
    """A legacy rank's row count of each section of fused tensor `name`, from its own and its sibling tensors'
    local shapes (`shape_of`: name -> shape, None where rank file `where` has no such tensor): value heads
    (A_log), value channels (out_proj's columns), and query/key channels (what is left); None when `name` fuses
    nothing."""
    key = _fused(name)
    if key is None:
        return None
    prefix = name[:-len(key)] + "self_attention."
    heads, proj = shape_of(prefix + "A_log"), shape_of(prefix + "out_proj.weight")
    if heads is None or proj is None:
        raise MergerError(f"tensor {name} belongs to a Gated DeltaNet whose A_log or out_proj.weight is missing "
                          f"from the same rank file, so its sections cannot be told apart, {where}")
    v_heads, values, rows = heads[0], proj[1], shape_of(name)[0]
    key_rows = rows - 2 * values - 2 * v_heads if key == IN_PROJ else rows - values
    if key_rows <= 0 or key_rows % 2:
        raise MergerError(f"tensor {name} has {rows} rows per rank, which {values} value channels and {v_heads} "
                          f"value heads per rank do not fit as Gated DeltaNet sections, {where}")
    qk = key_rows // 2
    return (qk, qk, values, values, v_heads, v_heads) if key == IN_PROJ else (qk, qk, values)


def joined_sections(pieces: dict[str, list[ShardPiece]], shapes: dict[str, tuple[int, ...]], dtypes: dict,
                    where: str) -> None:
    """torch_dist's section tensors (`<fused>.<section>`), in place: each fused tensor's sections become one
    tensor, section after section along dim 0, its pieces shifted there."""
    groups: dict[str, dict[str, str]] = {}
    for name in list(pieces):
        base, _, section = name.rpartition(".")
        if _fused(base) is not None and section in SECTIONS[_fused(base)]:
            groups.setdefault(base, {})[section] = name
    for base, found in groups.items():
        names = SECTIONS[_fused(base)]
        missing = [s for s in names if s not in found]
        if missing:
            raise MergerError(f"tensor {base} has sections {', '.join(found)} but not {', '.join(missing)}, {where}")
        start, joined = 0, []
        for section in names:
            name = found[section]
            joined += [ShardPiece((p.offsets[0] + start, *p.offsets[1:]), p.sizes, p.copies) for p in pieces.pop(name)]
            shape, dtype = shapes.pop(name), dtypes.pop(name)
            start += shape[0]
        pieces[base], shapes[base], dtypes[base] = joined, (start, *shape[1:]), dtype
