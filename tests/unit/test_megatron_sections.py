"""Gated DeltaNet's fused tensors as both Megatron catalogs present them (merger/sources/megatron_sections.py), alone.

Oracle: megatron-core's own layout, built here with plain tensor ops: a TP rank's in_proj is its [q k v z b a]
rows one after another (GatedDeltaNet.forward splits it so), torch_dist saves each section as a global tensor of
its own (`in_proj.weight.query`, ...: its sharded_state_dict). Both must read as the sections whole, one after
another; the real checkpoints (tests/test_megatron_gdn.py) check the same against Megatron's logits.
"""
from __future__ import annotations

import pytest
import torch

from merger.catalog import PieceCopy, ShardPiece
from merger.errors import MergerError
from merger.sources.megatron_sections import joined_sections, local_sections

pytestmark = pytest.mark.unit

LAYER = "decoder.layers.3.self_attention."
QK, V, HEADS, HIDDEN, TP = 4, 6, 3, 5, 2  # per rank
SECTIONS = ("query", "key", "value", "z", "beta", "alpha")


def _local_shapes() -> dict[str, tuple[int, ...]]:
    return {LAYER + "in_proj.weight": (2 * QK + 2 * V + 2 * HEADS, HIDDEN), LAYER + "conv1d.weight": (2 * QK + V, 1, 4),
            LAYER + "A_log": (HEADS,), LAYER + "out_proj.weight": (HIDDEN, V)}


def test_a_legacy_rank_s_sections_come_from_its_sibling_tensors():
    shapes = _local_shapes()
    assert local_sections(LAYER + "in_proj.weight", shapes.get, "f") == (QK, QK, V, V, HEADS, HEADS)
    assert local_sections(LAYER + "conv1d.weight", shapes.get, "f") == (QK, QK, V)
    assert local_sections(LAYER + "out_proj.weight", shapes.get, "f") is None
    assert local_sections("decoder.layers.3.mixer.in_proj.weight", shapes.get, "f") is None  # a Mamba layer's


def test_a_legacy_gated_deltanet_without_its_a_log_is_an_error_naming_the_file():
    shapes = _local_shapes()
    del shapes[LAYER + "A_log"]
    with pytest.raises(MergerError, match=r"in_proj.weight belongs to a Gated DeltaNet whose A_log .* rank_01.pt"):
        local_sections(LAYER + "in_proj.weight", shapes.get, "rank_01.pt")


def test_torch_dist_sections_read_as_the_one_tensor_megatron_fused():
    """Each section saved as torch_dist does (a global tensor per section, one piece per TP rank) reads back as
    the ranks' fused in_proj tensors' sections placed whole, one after another."""
    sizes = (QK, QK, V, V, HEADS, HEADS)
    ranks = [torch.randn(sum(sizes), HIDDEN) for _ in range(TP)]  # each rank's fused [q k v z b a]
    pieces, shapes, dtypes, data = {}, {}, {}, {}
    for section, parts in zip(SECTIONS, zip(*(r.split(sizes) for r in ranks))):
        name = f"{LAYER}in_proj.weight.{section}"
        pieces[name] = [ShardPiece((tp * len(part), 0), tuple(part.shape), (PieceCopy("f", f"{name}/{tp}"),))
                        for tp, part in enumerate(parts)]
        shapes[name], dtypes[name] = (TP * parts[0].shape[0], HIDDEN), torch.float32
        data.update({f"{name}/{tp}": part for tp, part in enumerate(parts)})
    joined_sections(pieces, shapes, dtypes, "ckpt")
    assert list(pieces) == [LAYER + "in_proj.weight"] and shapes[LAYER + "in_proj.weight"] == (TP * sum(sizes), HIDDEN)
    whole = torch.empty(shapes[LAYER + "in_proj.weight"])
    for piece in pieces[LAYER + "in_proj.weight"]:
        rows = slice(piece.offsets[0], piece.offsets[0] + piece.sizes[0])
        whole[rows] = data[piece.copies[0].key]
    expected = torch.cat([torch.cat(parts) for parts in zip(*(r.split(sizes) for r in ranks))])
    assert torch.equal(whole, expected)


def test_torch_dist_missing_a_section_is_an_error():
    pieces = {f"{LAYER}conv1d.weight.{s}": [ShardPiece((0, 0, 0), (QK, 1, 4), ())] for s in ("query", "value")}
    shapes = {n: (QK, 1, 4) for n in pieces}
    with pytest.raises(MergerError, match=r"conv1d.weight has sections query, value but not key, ckpt"):
        joined_sections(pieces, shapes, {n: torch.float32 for n in pieces}, "ckpt")
