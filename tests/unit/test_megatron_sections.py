"""Megatron tensors held per TP rank as several sections (sources/megatron_sections.py), alone: the sizes a legacy
rank file's shapes give, and the torch_dist section keys joined into one tensor.

Oracle: megatron-core 0.16.1's MambaMixer layout, written out by hand: a rank of TP t holds in_proj rows
[d/t, d/t, g*n/t, g*n/t, h/t] (z, x, B, C, dt), conv1d rows [d/t, g*n/t, g*n/t] (x, B, C), out_proj [H, d/t] and
A_log [h/t], for d = heads x head dim, g groups of state size n, h heads; torch_dist stores each section as its own
global tensor `<name>.<section>`, split over the ranks along dim 0. GatedDeltaNet's the same way: a rank's in_proj
is its [q k v z beta alpha] rows (GatedDeltaNet.forward splits it so), conv1d its [q k v] channels. The real
checkpoints (tests/test_megatron_nemotron_h.py, tests/test_megatron_gdn.py) check the same against Megatron's
logits.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from merger.catalog import PieceCopy, ShardPiece, SourceTensor
from merger.errors import MergerError
from merger.sources.megatron_dist import join_sections
from merger.sources.megatron_sections import local_sections, section_of

pytestmark = pytest.mark.unit

HIDDEN, INNER, STATES, HEADS, TP = 64, 128, 32, 8, 2  # d = 8 heads x 16, 2 groups x state 16
MIXER = "decoder.layers.2.mixer."
DELTANET = "decoder.layers.3.self_attention."
QK, V, V_HEADS = 4, 6, 3  # a Gated DeltaNet's query/key channels, value channels and value heads per rank


def _rank_shapes() -> dict[str, tuple[int, ...]]:
    d, gn, h = INNER // TP, STATES // TP, HEADS // TP
    return {MIXER + "in_proj.weight": (2 * d + 2 * gn + h, HIDDEN), MIXER + "conv1d.weight": (d + 2 * gn, 1, 4),
            MIXER + "conv1d.bias": (d + 2 * gn,), MIXER + "out_proj.weight": (HIDDEN, d), MIXER + "A_log": (h,),
            MIXER + "D": (h,), MIXER + "dt_bias": (h,), MIXER + "norm.weight": (d,)}


def test_a_mamba_rank_shard_has_the_sections_megatron_lays_out():
    shapes = _rank_shapes()
    d, gn, h = INNER // TP, STATES // TP, HEADS // TP
    assert local_sections(MIXER + "in_proj.weight", shapes, "f") == (d, d, gn, gn, h)
    assert local_sections(MIXER + "conv1d.weight", shapes, "f") == (d, gn, gn)
    assert local_sections(MIXER + "conv1d.bias", shapes, "f") == (d, gn, gn)
    for whole in ("out_proj.weight", "A_log", "D", "dt_bias", "norm.weight"):
        assert local_sections(MIXER + whole, shapes, "f") is None


def test_a_gated_fc1_has_two_halves_and_a_plain_one_none():
    fc1, fc2 = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"
    assert local_sections(fc1, {fc1: (40, 32), fc2: (32, 20)}, "f") == (20, 20)
    assert local_sections(fc1, {fc1: (20, 32), fc2: (32, 20)}, "f") is None


def test_a_mixer_shard_that_its_sections_do_not_fill_is_refused_naming_it():
    shapes = _rank_shapes()
    shapes[MIXER + "in_proj.weight"] = (shapes[MIXER + "in_proj.weight"][0] + 1, HIDDEN)
    with pytest.raises(MergerError, match=r"tensor decoder.layers.2.mixer.in_proj.weight has 165 rows, not the "
                                          r"64 \+ 64 \+ 16 \+ 16 \+ 4 of its sections .*, rank0.pt"):
        local_sections(MIXER + "in_proj.weight", shapes, "rank0.pt")


def test_section_keys_are_known_by_their_tensor_and_place():
    assert section_of(MIXER + "in_proj.weight.B") == (MIXER + "in_proj.weight", 2, 5)
    assert section_of(MIXER + "conv1d.bias.C") == (MIXER + "conv1d.bias", 2, 3)
    assert section_of(MIXER + "in_proj.weight.q") is None
    assert section_of(DELTANET + "in_proj.weight.beta") == (DELTANET + "in_proj.weight", 4, 6)
    assert section_of(DELTANET + "conv1d.weight.value") == (DELTANET + "conv1d.weight", 2, 3)
    assert section_of(DELTANET + "conv1d.weight.z") is None  # conv1d holds no z
    assert section_of("decoder.layers.1.self_attention.linear_qkv.weight.z") is None  # a tensor of one section


def _stored(name: str, rows: int) -> SourceTensor:
    """A torch_dist section tensor as TP ranks wrote it: half its rows each."""
    half = rows // TP
    pieces = tuple(ShardPiece((r * half, 0), (half, HIDDEN), (PieceCopy(f"__{r}_0.distcp", f"{name}@{r}"),))
                   for r in range(TP))
    return SourceTensor(name, (rows, HIDDEN), torch.float32, pieces)


def test_torch_dist_sections_join_into_the_whole_tensor_in_their_order():
    sizes = {"z": INNER, "x": INNER, "B": STATES, "C": STATES, "dt": HEADS}
    name = MIXER + "in_proj.weight"
    stored = {f"{name}.{s}": _stored(f"{name}.{s}", rows) for s, rows in reversed(sizes.items())}
    stored["decoder.final_norm.weight"] = _stored("decoder.final_norm.weight", 2)
    joined = join_sections(stored, Path("ckpt"))
    assert list(joined) == [name, "decoder.final_norm.weight"]
    whole = joined[name]
    assert whole.shape == (sum(sizes.values()), HIDDEN)
    start = 0
    for section, rows in sizes.items():
        for r in range(TP):
            piece = next(p for p in whole.pieces if p.copies[0].key == f"{name}.{section}@{r}")
            assert piece.offsets == (start + r * rows // TP, 0) and piece.sizes == (rows // TP, HIDDEN)
        start += rows


def test_torch_dist_sections_with_one_missing_are_refused_naming_them():
    name = MIXER + "conv1d.weight"
    stored = {f"{name}.{s}": _stored(f"{name}.{s}", 32) for s in ("x", "C")}
    with pytest.raises(MergerError, match=r"tensor decoder.layers.2.mixer.conv1d.weight lacks sections"):
        join_sections(stored, Path("ckpt"))


def _deltanet_shapes() -> dict[str, tuple[int, ...]]:
    return {DELTANET + "in_proj.weight": (2 * QK + 2 * V + 2 * V_HEADS, HIDDEN),
            DELTANET + "conv1d.weight": (2 * QK + V, 1, 4), DELTANET + "A_log": (V_HEADS,),
            DELTANET + "out_proj.weight": (HIDDEN, V)}


def test_a_gated_deltanet_rank_shard_has_its_sections_from_its_sibling_tensors():
    shapes = _deltanet_shapes()
    assert local_sections(DELTANET + "in_proj.weight", shapes, "f") == (QK, QK, V, V, V_HEADS, V_HEADS)
    assert local_sections(DELTANET + "conv1d.weight", shapes, "f") == (QK, QK, V)
    assert local_sections(DELTANET + "out_proj.weight", shapes, "f") is None


def test_a_gated_deltanet_without_its_a_log_is_refused_naming_the_file():
    shapes = _deltanet_shapes()
    del shapes[DELTANET + "A_log"]
    with pytest.raises(MergerError, match=r"Gated DeltaNet tensor .*in_proj.weight without its .*A_log.* rank_01.pt"):
        local_sections(DELTANET + "in_proj.weight", shapes, "rank_01.pt")


def test_a_gated_deltanet_shard_its_sections_do_not_fit_is_refused():
    shapes = _deltanet_shapes()
    shapes[DELTANET + "in_proj.weight"] = (2 * V + 2 * V_HEADS + 1, HIDDEN)  # an odd count left for q and k
    with pytest.raises(MergerError, match=r"has 19 rows, which 6 value channels and 3 value heads do not fit"):
        local_sections(DELTANET + "in_proj.weight", shapes, "f")


def test_torch_dist_gated_deltanet_sections_read_as_the_tensor_megatron_fused():
    """Each section saved as torch_dist does (a global tensor per section, a piece per TP rank) reads back as the
    ranks' fused in_proj sections placed whole, one after another: the bytes are moved here, not only offsets."""
    sizes = (QK, QK, V, V, V_HEADS, V_HEADS)
    ranks = [torch.randn(sum(sizes), HIDDEN) for _ in range(TP)]  # each rank's fused [q k v z beta alpha]
    name, stored, data = DELTANET + "in_proj.weight", {}, {}
    for section, parts in zip(("query", "key", "value", "z", "beta", "alpha"), zip(*(r.split(sizes) for r in ranks))):
        key = f"{name}.{section}"
        pieces = tuple(ShardPiece((tp * len(part), 0), tuple(part.shape), (PieceCopy("f", f"{key}@{tp}"),))
                       for tp, part in enumerate(parts))
        stored[key] = SourceTensor(key, (TP * len(parts[0]), HIDDEN), torch.float32, pieces)
        data.update({f"{key}@{tp}": part for tp, part in enumerate(parts)})
    whole = join_sections(stored, Path("ckpt"))[name]
    assembled = torch.empty(whole.shape)
    for piece in whole.pieces:
        assembled[piece.offsets[0]:piece.offsets[0] + piece.sizes[0]] = data[piece.copies[0].key]
    assert torch.equal(assembled, torch.cat([torch.cat(parts) for parts in zip(*(r.split(sizes) for r in ranks))]))
