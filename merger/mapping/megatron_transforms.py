"""Pure tensor transforms from Megatron's layouts to HF's, each with its shape rule beside it.

The grouped QKV layout stacks, per query group, that group's query heads then one key and one value head:
rows = groups x (heads_per_group + 2) x head_dim (MHA: groups = heads; MQA: groups = 1).
"""
from __future__ import annotations

import torch

from ..errors import MergerError


def qkv_shapes(shape: tuple[int, ...], heads: int, groups: int, head_dim: int, name: str) -> list[tuple[int, ...]]:
    if heads % groups or shape[0] != groups * (heads // groups + 2) * head_dim:
        raise MergerError(f"tensor {name} has {shape[0]} rows; {heads} heads in {groups} query groups of head "
                          f"dim {head_dim} need {groups * (heads // groups + 2) * head_dim} (check config.json)")
    rest = tuple(shape[1:])
    return [(heads * head_dim, *rest), (groups * head_dim, *rest), (groups * head_dim, *rest)]


def split_qkv(tensors: list[torch.Tensor], heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    (w,) = tensors
    rest = w.shape[1:]
    per = heads // groups
    q, k, v = w.reshape(groups, (per + 2) * head_dim, *rest).split([per * head_dim, head_dim, head_dim], dim=1)
    return [q.reshape(heads * head_dim, *rest), k.reshape(groups * head_dim, *rest),
            v.reshape(groups * head_dim, *rest)]


def gate_up_shapes(shape: tuple[int, ...], name: str) -> list[tuple[int, ...]]:
    if shape[0] % 2:
        raise MergerError(f"gated tensor {name} has an odd number of rows ({shape[0]}), so it is not [gate; up]")
    return [(shape[0] // 2, *shape[1:])] * 2


def split_gate_up(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fc1 as the catalog gives it, cat(gate, up) (legacy per-rank halves are re-placed by their pieces)."""
    return list(tensors[0].chunk(2, dim=0))


def vocab_shapes(shape: tuple[int, ...], vocab: int, name: str) -> list[tuple[int, ...]]:
    if shape[0] < vocab:
        raise MergerError(f"tensor {name} has {shape[0]} vocab rows, fewer than config.json's vocab_size {vocab}")
    return [(vocab, *shape[1:])]


def unpad_vocab(tensors: list[torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """Megatron pads the vocab to a multiple of 128 x TP; the rows past HF's vocab size are padding."""
    return [tensors[0][:vocab]]
