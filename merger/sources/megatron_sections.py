"""Megatron tensors whose TP shard is several sections one after the other, each split over TP on its own.

TP rank r of a gated MLP's fc1 holds [gate_r; up_r], a Mamba2 mixer's in_proj [z_r; x_r; B_r; C_r; dt_r] and its
conv1d [x_r; B_r; C_r], a Gated DeltaNet's in_proj [q_r; k_r; v_r; z_r; beta_r; alpha_r] and its conv1d
[q_r; k_r; v_r]. The whole tensor is each section whole, one after the other ([gate; up], [z; x; B; C; dt], ...),
as HF keeps them and torch_dist stores them: fc1 as one tensor, the mixers' in_proj and conv1d as one tensor per
section (`<name>.<section>`: megatron-core's MambaMixer.sharded_state_dict, GatedDeltaNet's
`_split_tensor_factory`). Neither format records the section sizes: a legacy catalog derives them from the shapes
of the layer's other tensors in the same rank file, and a torch_dist catalog joins the sections it finds in this
order.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import MergerError

# A Mamba2 mixer's and a Gated DeltaNet's sectioned tensors (names end so) and their sections, in order.
MAMBA = {"mixer.in_proj.weight": ("z", "x", "B", "C", "dt"), "mixer.conv1d.weight": ("x", "B", "C"),
         "mixer.conv1d.bias": ("x", "B", "C")}
GATED_DELTANET = {"self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
                  "self_attention.conv1d.weight": ("query", "key", "value"),
                  "self_attention.conv1d.bias": ("query", "key", "value")}
SECTIONS = MAMBA | GATED_DELTANET


def local_sections(name: str, shapes: Mapping[str, tuple[int, ...]], where: str) -> tuple[int, ...] | None:
    """The dim-0 sizes of the sections of tensor `name`'s shard on one TP rank, from the shapes of the tensors its
    rank file holds (`shapes`, by name), or None for a tensor of one section."""
    rows = shapes[name][0]
    if name.endswith("linear_fc1.weight"):  # gated when it has twice the rows fc2 has columns
        fc2 = shapes.get(name.replace("linear_fc1.weight", "linear_fc2.weight"))
        return (rows // 2, rows // 2) if fc2 is not None and rows == 2 * fc2[1] else None
    if suffix := next((s for s in GATED_DELTANET if name.endswith(s)), None):
        return _deltanet_sections(name, suffix, shapes, where)
    suffix = next((s for s in MAMBA if name.endswith(s)), None)
    if suffix is None:
        return None
    mixer = name[:-len(suffix)] + "mixer."
    try:
        inner = shapes[mixer + "out_proj.weight"][1]  # the rank's heads x head dim
        heads = shapes[mixer + "A_log"][0]
        states = (shapes[mixer + "conv1d.weight"][0] - inner) // 2  # the rank's groups x state size
    except (KeyError, IndexError) as e:
        raise MergerError(f"Mamba2 mixer tensor {name} without its {e} beside it, {where}") from e
    sizes = (inner, inner, states, states, heads) if suffix == "mixer.in_proj.weight" else (inner, states, states)
    if sum(sizes) != rows:
        raise MergerError(f"Mamba2 mixer tensor {name} has {rows} rows, not the {' + '.join(map(str, sizes))} of "
                          f"its sections {MAMBA[suffix]}, {where}")
    return sizes


def _deltanet_sections(name: str, suffix: str, shapes: Mapping[str, tuple[int, ...]], where: str
                       ) -> tuple[int, ...]:
    """A Gated DeltaNet shard's sections: value heads (A_log's rows), value channels (out_proj's columns), and the
    query and key channels, as many as each other, in what is left."""
    layer, rows = name[:-len(suffix)] + "self_attention.", shapes[name][0]
    try:
        heads, values = shapes[layer + "A_log"][0], shapes[layer + "out_proj.weight"][1]
    except (KeyError, IndexError) as e:
        raise MergerError(f"Gated DeltaNet tensor {name} without its {e} beside it, {where}") from e
    in_proj = suffix == "self_attention.in_proj.weight"
    keys = rows - 2 * values - 2 * heads if in_proj else rows - values
    if keys <= 0 or keys % 2:
        raise MergerError(f"Gated DeltaNet tensor {name} has {rows} rows, which {values} value channels and {heads} "
                          f"value heads do not fit as its sections {GATED_DELTANET[suffix]}, {where}")
    return (keys // 2, keys // 2, values, values, heads, heads) if in_proj else (keys // 2, keys // 2, values)


def section_of(name: str) -> tuple[str, int, int] | None:
    """A torch_dist section's (whole tensor's name, its place, the section count), or None for another name."""
    base, _, section = name.rpartition(".")
    for suffix, sections in SECTIONS.items():
        if base.endswith(suffix) and section in sections:
            return base, sections.index(section), len(sections)
    return None
