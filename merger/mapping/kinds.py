"""The kinds of row a family's table may hold (family.py), each registered once: how many HF names a row of the
kind gives, and its plan, the HF shapes a source tensor becomes with the transform that makes them (None: the
tensor as it is, written as a cast the reading rank can place itself). A new transform is one more registered
kind, testable alone through its plan; a row naming a kind not registered here is refused when its table is
imported. A join (`cat_dim`) has no plan of its own: it writes its row's source and the tensors the row joins
as one HF tensor, concatenated along that dim (`step`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..errors import MergerError
from . import gdn_transforms as gdn
from . import transforms as tf
from .steps import OutputSpec, Step, Transform, cast

# (source name, its shape, config.json) -> the HF shapes it becomes and the transform (None: as it is)
Plan = Callable[[str, tuple[int, ...], dict], tuple[list[tuple[int, ...]], Transform | None]]


@dataclass(frozen=True)
class Kind:
    name: str
    targets: int  # the HF names a row of this kind gives; 0: a skip, whose row says why instead
    plan: Plan | None  # None: a skip, never planned, or a join
    # An [E, ...] stack of a MoE layer's routed experts, each expert's part written under its own HF name (`{e}`
    # in the row's target); the plan is one expert's.
    per_expert: bool = False
    cat_dim: int | None = None  # a join: the dim its parts are concatenated along
    # An [E, ...] stack of experts, transformed alike expert by expert into the [E, ...] stack HF keeps on disk
    # (gpt-oss): a stored stack of this kind (torchtitan's) is read and written an expert at a time (stacked_steps).
    expertwise: bool = False


def head_counts(config: dict) -> tuple[int, int, int]:
    """(query heads, key-value heads, head dim) of the attention, from the HF config."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as e:
        raise MergerError(f"config.json has no {e} (the attention's head counts come from the HF config of the "
                          f"model, --hf_model_config_path)") from e
    return heads, int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads)


def layer_attention(config: dict, name: str) -> tuple[int, int, int, int]:
    """(query heads, key-value heads, q/k head dim, value head dim) of the layer source tensor `name` is in, for a
    model whose layer types differ in their key-value heads (MiMo-V2-Flash: transformers' MiMoV2FlashAttention gives
    a sliding-window layer twice num_key_value_heads, every layer values v_head_dim wide)."""
    heads, groups, head_dim = head_counts(config)
    layer = re.search(r"layers\.(\d+)\.", name)
    types = config.get("layer_types")
    if layer is None or not isinstance(types, list) or int(layer[1]) >= len(types):
        # a release's own config.json may give the pattern under another name (MiMo's hybrid_layer_pattern), which
        # transformers does not read: its save_pretrained of the loaded config writes layer_types
        raise MergerError(f"config.json's layer_types does not give the type of the layer of tensor {name} (the HF "
                          f"config of the model as transformers' save_pretrained writes it, --hf_model_config_path)")
    if types[int(layer[1])] == "sliding_attention":
        groups *= 2
    return heads, groups, head_dim, int(config.get("v_head_dim") or head_dim)


def _as_is(name: str, shape: tuple[int, ...], config: dict):
    return [shape], None


def _qkv(name: str, shape: tuple[int, ...], config: dict):
    heads, groups, head_dim = head_counts(config)
    return tf.qkv_shapes(shape, heads, groups, head_dim, name), partial(
        tf.split_qkv, heads=heads, groups=groups, head_dim=head_dim)


def _layer_qkv(name: str, shape: tuple[int, ...], config: dict):
    heads, groups, head_dim, v_head_dim = layer_attention(config, name)
    return tf.qkv_shapes(shape, heads, groups, head_dim, name, v_head_dim), partial(
        tf.split_qkv, heads=heads, groups=groups, head_dim=head_dim, v_head_dim=v_head_dim)


def _vision_qkv(name: str, shape: tuple[int, ...], config: dict):
    vision = config.get("vision_config") or {}
    try:
        heads, hidden = int(vision["num_heads"]), int(vision["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise MergerError(f"config.json's vision_config has no {e} (the vision tower's heads of tensor {name} come "
                          f"from the HF config of the model, --hf_model_config_path)") from e
    tf.qkv_shapes(shape, heads, heads, hidden // heads, name)  # the rows the heads need, checked
    return [shape], partial(tf.qkv_by_part, heads=heads, head_dim=hidden // heads)


def _gate_up(name: str, shape: tuple[int, ...], config: dict):
    return tf.gate_up_shapes(shape, name), tf.split_gate_up


def _vocab(name: str, shape: tuple[int, ...], config: dict):
    vocab = config["vocab_size"]
    shapes = tf.vocab_shapes(shape, vocab, name)
    # no padding rows: as it is (a plain cast, which each rank places where it reads it)
    return shapes, None if shapes[0] == shape else partial(tf.unpad_vocab, vocab=vocab)


def _rotary(key_value: bool, name: str, shape: tuple[int, ...], config: dict):
    heads, groups, head_dim = head_counts(config)
    count = groups if key_value else heads
    return tf.rotary_shapes(shape, count, head_dim, name), partial(tf.permute_rotary, heads=count)


def _with_zero_bias(name: str, shape: tuple[int, ...], config: dict):
    return [shape, (1, shape[0])], tf.with_zero_bias


def _one_expert(name: str, shape: tuple[int, ...], config: dict):
    return [shape[1:]], None


def _swapped(name: str, shape: tuple[int, ...], config: dict):
    return tf.swapped_shapes(shape), tf.swap_last_dims


def _interleaved(swap: bool, name: str, shape: tuple[int, ...], config: dict):
    return tf.interleaved_shapes(shape, swap, name), partial(tf.interleave_gate_up, swap=swap)


def _patch_conv3d(name: str, shape: tuple[int, ...], config: dict):
    # transformers' Qwen3.5 vision config defaults, where config.json leaves them out
    vision = config.get("vision_config") or {}
    kernel = (vision.get("in_channels", 3), vision.get("temporal_patch_size", 2), vision.get("patch_size", 16))
    shapes = tf.patch_conv_shapes(shape, kernel, name)
    return shapes, partial(tf.reshape, shape=shapes[0])


def _patch_conv2d(name: str, shape: tuple[int, ...], config: dict):
    # transformers' Kimi-K2.5 vision config default where config.json leaves it out; its Conv2d takes 3 channels
    shapes = tf.patch_conv_shapes(shape, (3, (config.get("vision_config") or {}).get("patch_size", 14)), name)
    return shapes, partial(tf.reshape, shape=shapes[0])


def _gated_qkv(name: str, shape: tuple[int, ...], config: dict):
    heads, groups, head_dim = head_counts(config)
    return gdn.gated_qkv_shapes(shape, heads, groups, head_dim, name), partial(
        gdn.split_gated_qkv, heads=heads, groups=groups, head_dim=head_dim)


def _deltanet_in_proj(grouped: bool, name: str, shape: tuple[int, ...], config: dict):
    dims = gdn.DeltaNetDims.of(config)
    if grouped:
        return gdn.grouped_in_proj_shapes(shape, dims, name), partial(gdn.split_grouped_in_proj, dims=dims)
    return gdn.flat_in_proj_shapes(shape, dims, name), partial(gdn.split_flat_in_proj, dims=dims)


def _plus_one(name: str, shape: tuple[int, ...], config: dict):
    return [shape], gdn.plus_one


KINDS: dict[str, Kind] = {}


def register(*kinds: Kind) -> None:
    for kind in kinds:
        if kind.name in KINDS:
            raise ValueError(f"kind {kind.name!r} is registered twice")
        KINDS[kind.name] = kind


register(
    Kind("rename", 1, _as_is),
    Kind("qkv", 3, _qkv),  # Megatron's fused QKV: q, k, v
    # the same with its layer's own key-value heads and values v_head_dim wide (MiMo-V2-Flash: layer_attention)
    Kind("layer_qkv", 3, _layer_qkv),
    # a ViT's fused QKV, a query group per head (per head [q; k; v]), as HF's one qkv [q; k; v] (Qwen3-VL's
    # tower: vision_config's num_heads and hidden_size)
    Kind("vision_qkv", 1, _vision_qkv),
    Kind("gate_up", 2, _gate_up),  # a gated fc1, cat(gate, up): gate, up
    Kind("vocab", 1, _vocab),  # Megatron's padded vocab rows, unpadded
    Kind("rotary_q", 1, partial(_rotary, False)),  # torchtitan Llama's wq, permuted by query head
    Kind("rotary_kv", 1, partial(_rotary, True)),  # its wk, permuted by key-value head
    Kind("experts", 1, _one_expert, per_expert=True),
    # a stacked expert tensor transformers also keeps stacked on disk (gpt-oss), written with its last two dims
    # swapped (an expert's slab at a time), gate and up still interleaved as both interleave them
    Kind("experts_fused", 1, _swapped, expertwise=True),
    # Megatron's experts' fc1 stacked (a `stacked` row), cat(gate, up) per expert, as gpt-oss's gate_up_proj_bias
    # (gate and up interleaved) and its gate_up_proj (interleaved, then [E, in, out] as experts_fused writes it)
    Kind("gate_up_interleaved", 1, partial(_interleaved, False), expertwise=True),
    Kind("experts_gate_up_interleaved", 1, partial(_interleaved, True), expertwise=True),
    # a softmax router as ERNIE-4.5's gate and its moe_statics correction bias, which megatron-core cannot train
    # (it takes an expert bias with sigmoid scores only): written as 0, which chooses as Megatron's router did
    Kind("router_zero_bias", 2, _with_zero_bias),
    Kind("skip", 0, None),  # no HF equivalent: left out, for the reason its row gives
    # torchtitan's Qwen3.5 Gated DeltaNet keeps q, k and v apart (projections, conv channels) where HF fuses them
    # (in_proj_qkv, conv1d): rows [q; k; v]
    Kind("cat", 1, None, cat_dim=0),
    Kind("joined", 0, None),  # a tensor a join writes with its row's source: its row is made by the join's
    # a ViT's patch embedding as a Linear over flattened patches [D, C*T*P*P] (torchtitan's Qwen3.5), as HF's Conv3d
    # [D, C, T, P, P] (the same numbers: the Conv3d's stride is its kernel)
    Kind("patch_conv3d", 1, _patch_conv3d),
    # the same over one frame (torchtitan's Kimi-K2.5 MoonViT, [D, C*P*P]), as HF's Conv2d [D, C, P, P]
    Kind("patch_conv2d", 1, _patch_conv2d),
    # megatron-core's Gated DeltaNet hybrids (gdn_transforms.py): gated attention's fused QKV (q_proj, k_proj,
    # v_proj), the Gated DeltaNet's input projection flat (qwen3_5: in_proj_qkv, _z, _b, _a) or grouped per key
    # head (qwen3_next: in_proj_qkvz, in_proj_ba), and a zero-centred norm weight as a plain one (+1)
    Kind("gated_qkv", 3, _gated_qkv),
    Kind("deltanet_in_proj", 4, partial(_deltanet_in_proj, False)),
    Kind("deltanet_in_proj_grouped", 2, partial(_deltanet_in_proj, True)),
    Kind("zero_centred_norm", 1, _plus_one),
)


def step(name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str, targets: tuple[str, ...],
         config: dict, joined: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> Step:
    """The step writing source tensor `name` as `targets` under its row's `kind`; a join writes it and the
    `joined` tensors (name, shape) after it as its one target."""
    dim = KINDS[kind].cat_dim
    if dim is not None:
        names, shapes = (name, *(n for n, _ in joined)), [shape, *(s for _, s in joined)]
        return Step(names, (OutputSpec(targets[0], tf.cat_shape(shapes, dim, names), dtype),),
                    partial(tf.cat, dim=dim))
    shapes, fn = KINDS[kind].plan(name, shape, config)
    if fn is None:
        return cast(name, targets[0], shape, dtype)
    return Step((name,), tuple(OutputSpec(t, s, dtype) for t, s in zip(targets, shapes)), fn)


def stacked_steps(experts: list[str], stack: tuple[int, ...], dtype: torch.dtype, kind: str, target: str,
                  config: dict) -> list[Step]:
    """The steps writing the source tensors `experts` (one expert's each, in expert order) as HF's stack `target`
    [E, ...] under `kind`, applied to the `stack` they form: one step per expert, writing that expert's slab (its
    row of the stack, OutputSpec.rows), so no rank holds the whole stack."""
    shapes, fn = KINDS[kind].plan(experts[0], stack, config)
    each = partial(tf.stack_slab, each=fn)
    return [Step((name,), (OutputSpec(target, shapes[0], dtype, rows=(e, e + 1)),), each)
            for e, name in enumerate(experts)]
