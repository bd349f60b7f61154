"""Pure tensor transforms from a training framework's layouts to HF's, each with its shape rule beside it.

Megatron's grouped QKV layout stacks, per query group, that group's query heads then one key and one value head:
rows = groups x (heads_per_group + 2) x head_dim (MHA: groups = heads; MQA: groups = 1; MiMo-V2-Flash's values are
narrower than its heads: groups x (heads_per_group x head_dim + head_dim + v_head_dim)). torchtitan's Llama (like
Meta's original) applies rotary embeddings to adjacent pairs of each head's channels, HF's Llama rotates the first
half of a head against the second half, so the same model in HF stores q_proj / k_proj rows permuted within each
head (row 2i goes to row i and row 2i+1 to row i + head_dim/2).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import MergerError


def qkv_shapes(shape: tuple[int, ...], heads: int, groups: int, head_dim: int, name: str,
               v_head_dim: int | None = None) -> list[tuple[int, ...]]:
    """q, k and v's shapes; values `v_head_dim` wide where they are not head_dim (MiMo-V2-Flash)."""
    v_dim = v_head_dim or head_dim
    rows = groups * (heads // groups * head_dim + head_dim + v_dim) if groups else 0
    if not groups or heads % groups or shape[0] != rows:
        values = f" and values {v_dim} wide" if v_dim != head_dim else ""
        raise MergerError(f"tensor {name} has {shape[0]} rows; {heads} heads in {groups} query groups of head "
                          f"dim {head_dim}{values} need {rows} (check config.json)")
    rest = tuple(shape[1:])
    return [(heads * head_dim, *rest), (groups * head_dim, *rest), (groups * v_dim, *rest)]


def split_qkv(tensors: list[torch.Tensor], heads: int, groups: int, head_dim: int,
              v_head_dim: int | None = None) -> list[torch.Tensor]:
    """Megatron's fused QKV, per query group [its q heads; k; v], as HF's q, k and v."""
    (w,) = tensors
    rest = w.shape[1:]
    per, v_dim = heads // groups, v_head_dim or head_dim
    q, k, v = w.reshape(groups, per * head_dim + head_dim + v_dim, *rest).split([per * head_dim, head_dim, v_dim],
                                                                              dim=1)
    return [q.reshape(heads * head_dim, *rest), k.reshape(groups * head_dim, *rest),
            v.reshape(groups * v_dim, *rest)]


def qkv_by_part(tensors: list[torch.Tensor], heads: int, head_dim: int) -> list[torch.Tensor]:
    """Megatron's fused QKV with a query group per head (per head [q; k; v]: a ViT's attention) as one tensor
    [every head's q; every k; every v], HF's fused ViT qkv."""
    return [torch.cat(split_qkv(tensors, heads=heads, groups=heads, head_dim=head_dim))]


def gate_up_shapes(shape: tuple[int, ...], name: str) -> list[tuple[int, ...]]:
    if shape[0] % 2:
        raise MergerError(f"gated tensor {name} has an odd number of rows ({shape[0]}), so it is not [gate; up]")
    return [(shape[0] // 2, *shape[1:])] * 2


def split_gate_up(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fc1 as the catalog gives it, cat(gate, up) (legacy per-rank halves are re-placed by their pieces)."""
    return list(tensors[0].chunk(2, dim=0))


def with_zero_bias(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A router's weight [E, hidden] as it is, and the [1, E] score-correction bias HF keeps beside it, all 0: a
    router that chooses without a bias chooses as one whose bias is 0."""
    (w,) = tensors
    return [w, w.new_zeros(1, w.shape[0])]


def vocab_shapes(shape: tuple[int, ...], vocab: int, name: str) -> list[tuple[int, ...]]:
    if shape[0] < vocab:
        raise MergerError(f"tensor {name} has {shape[0]} vocab rows, fewer than config.json's vocab_size {vocab}")
    return [(vocab, *shape[1:])]


def unpad_vocab(tensors: list[torch.Tensor], vocab: int) -> list[torch.Tensor]:
    """Megatron pads the vocab to a multiple of 128 x TP; the rows past HF's vocab size are padding."""
    return [tensors[0][:vocab]]


def rotary_shapes(shape: tuple[int, ...], heads: int, head_dim: int, name: str) -> list[tuple[int, ...]]:
    if len(shape) != 2 or shape[0] != heads * head_dim or head_dim % 2:
        raise MergerError(f"tensor {name} is {shape} but config.json gives {heads} heads of dim {head_dim} "
                          f"(pass the HF config of this model with --hf_model_config_path)")
    return [shape]


def rotary_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads * head_dim, in] with pairs (2i, 2i+1) per head -> halves (i, i + head_dim/2) per head."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_rotary(tensors: list[torch.Tensor], heads: int) -> list[torch.Tensor]:
    return [rotary_permute(tensors[0], heads)]


def swapped_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [(*shape[:-2], shape[-1], shape[-2])]


def swap_last_dims(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[E, out, in] -> [E, in, out]: a stacked expert tensor as transformers keeps it on disk (gpt-oss)."""
    return [tensors[0].transpose(-2, -1)]


def interleaved_shapes(shape: tuple[int, ...], swap: bool, name: str) -> list[tuple[int, ...]]:
    if len(shape) < 2 or shape[1] % 2:
        raise MergerError(f"stacked gated tensor {name} is {shape}: its dim 1 is not [gate; up] (an even count)")
    return swapped_shapes(shape) if swap else [shape]


def interleave_gate_up(tensors: list[torch.Tensor], swap: bool) -> list[torch.Tensor]:
    """Stacked experts' fc1 [E, cat(gate, up), ...] -> [E, (gate_0, up_0, gate_1, up_1, ...), ...], as gpt-oss
    keeps gate_up_proj (and its bias), then with `swap` its last two dims swapped ([E, in, out], as it is saved)."""
    (w,) = tensors
    gate, up = w.chunk(2, dim=1)
    out = torch.stack([gate, up], dim=2).flatten(1, 2)
    return swap_last_dims([out]) if swap else [out]


def stack_slab(tensors: list[torch.Tensor], each: Callable | None) -> list[torch.Tensor]:
    """Consecutive experts' tensors, in expert order, as their slab [k, ...] of a stacked [E, ...] output, with
    `each` (a kind's transform of an [E, ...] stack, expert by expert alike) applied to the slab: the whole stack
    is never held, its slabs are written at their rows by their own steps."""
    slab = torch.stack(tensors)
    return [slab] if each is None else each([slab])


def cat_shape(shapes: list[tuple[int, ...]], dim: int, names: tuple[str, ...]) -> tuple[int, ...]:
    rest = {tuple(s[:dim]) + tuple(s[dim + 1:]) for s in shapes}
    if len(rest) != 1 or any(len(s) <= dim for s in shapes):
        raise MergerError(f"tensors {', '.join(names)} are {', '.join(map(str, shapes))}: they differ past dim {dim}, "
                          f"so they are not parts of one tensor")
    first = shapes[0]
    return (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1:])


def cat(tensors: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """Parts a framework keeps apart, as the one tensor HF fuses them into (torchtitan's Gated DeltaNet q, k, v)."""
    return [torch.cat(tensors, dim=dim)]


def patch_conv_shapes(shape: tuple[int, ...], kernel: tuple[int, ...], name: str) -> list[tuple[int, ...]]:
    """A patch embedding kept as a Linear [D, C*...] as HF's convolution [D, C, (T,) P, P]: `kernel` is
    (channels, frames, side) for a Conv3d, (channels, side) for a Conv2d."""
    channels, *frames, side = kernel
    if len(shape) != 2 or shape[1] != channels * math.prod(frames) * side * side:
        raise MergerError(f"tensor {name} is {shape}, but config.json's vision_config gives patches of {channels} "
                          f"channels x {''.join(f'{t} frames x ' for t in frames)}{side} x {side} (pass the HF config "
                          f"of this model with --hf_model_config_path)")
    return [(shape[0], channels, *frames, side, side)]


def reshape(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [tensors[0].reshape(shape)]
