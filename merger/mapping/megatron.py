"""Megatron names to HF names, one declarative table per model family, and the steps built from them.

A row is (Megatron suffix, kind, HF names): the suffix follows `decoder.layers.{i}.` for layer rows
(`{e}` is the global expert number), kind says which transform applies (rename, qkv, gate_up, vocab).
Adding a family is adding a table. Both local-spec and TE names appear (`input_layernorm.weight` or
`linear_qkv.layer_norm_weight`), since the layer spec decides which one a checkpoint holds.
"""
from __future__ import annotations

import re
from functools import partial

import torch

from ..catalog import Catalog
from ..engine.plan import OutputSpec, Step, output_dtype
from ..errors import MergerError
from ..options import MergeOptions
from . import transforms as tf
from .registry import ties_embeddings

GLOBAL = (
    ("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)),
    ("decoder.final_layernorm.weight", "rename", ("model.norm.weight",)),
    ("output_layer.weight", "vocab", ("lm_head.weight",)),
)
ATTENTION = (
    ("input_layernorm.weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.layer_norm_weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
    ("self_attention.linear_qkv.bias", "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias")),
    ("self_attention.linear_proj.weight", "rename", ("self_attn.o_proj.weight",)),
    ("pre_mlp_layernorm.weight", "rename", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.layer_norm_weight", "rename", ("post_attention_layernorm.weight",)),
)
QK_NORM = (
    ("self_attention.q_layernorm.weight", "rename", ("self_attn.q_norm.weight",)),
    ("self_attention.k_layernorm.weight", "rename", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    ("mlp.linear_fc1.weight", "gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", "rename", ("mlp.down_proj.weight",)),
)
EXPERTS = (
    ("mlp.router.weight", "rename", ("mlp.gate.weight",)),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
     ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("mlp.experts.{e}.down_proj.weight",)),
)
SHARED_EXPERT = (
    ("mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    ("mlp.shared_experts.linear_fc2.weight", "rename", ("mlp.shared_expert.down_proj.weight",)),
    ("mlp.shared_experts.gate_weight", "rename", ("mlp.shared_expert_gate.weight",)),
)
MIXTRAL_EXPERTS = (  # the hub's names, which transformers converts to its fused layout on load
    ("mlp.router.weight", "rename", ("block_sparse_moe.gate.weight",)),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
     ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight")),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("block_sparse_moe.experts.{e}.w2.weight",)),
)

FAMILIES = {
    "llama": ATTENTION + DENSE_MLP,
    "mistral": ATTENTION + DENSE_MLP,
    "qwen2": ATTENTION + DENSE_MLP,
    "qwen3": ATTENTION + QK_NORM + DENSE_MLP,
    "qwen2_moe": ATTENTION + DENSE_MLP + EXPERTS + SHARED_EXPERT,  # dense rows for mlp_only_layers
    "mixtral": ATTENTION + MIXTRAL_EXPERTS,
    "qwen3_moe": ATTENTION + QK_NORM + DENSE_MLP + EXPERTS,
}


def _compile(rows) -> list[tuple[re.Pattern, str, tuple[str, ...]]]:
    def pattern(suffix: str) -> str:
        return re.escape(suffix).replace(r"\{e\}", r"(?P<e>\d+)")

    out = [(re.compile(pattern(src)), kind, dst) for src, kind, dst in GLOBAL]
    for src, kind, dst in rows:
        out.append((re.compile(r"decoder\.layers\.(?P<i>\d+)\." + pattern(src)), kind,
                    tuple("model.layers.{i}." + d for d in dst)))
    return out


def family_of(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise MergerError(f"no Megatron mapping for model_type {model_type!r} (known: {', '.join(FAMILIES)}), "
                          f"config.json")
    return model_type


def _step(name: str, shape: tuple[int, ...], kind: str, targets: tuple[str, ...], config: dict,
          dtype) -> Step:
    if kind == "qkv":
        heads = config["num_attention_heads"]
        groups = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        shapes, fn = tf.qkv_shapes(shape, heads, groups, head_dim, name), partial(
            tf.split_qkv, heads=heads, groups=groups, head_dim=head_dim)
    elif kind == "gate_up":
        shapes, fn = tf.gate_up_shapes(shape, name), tf.split_gate_up
    elif kind == "vocab":
        vocab = config["vocab_size"]
        shapes, fn = tf.vocab_shapes(shape, vocab, name), partial(tf.unpad_vocab, vocab=vocab)
    else:
        return Step((name,), (OutputSpec(targets[0], shape, dtype),))
    return Step((name,), tuple(OutputSpec(t, s, dtype) for t, s in zip(targets, shapes)), fn)


def _zero_bias(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros(1)]


def _value_head(catalog: Catalog, options: MergeOptions) -> list[Step]:
    """verl's critic replaces the output layer with a replicated Linear(hidden, 1, bias=False): HF's `score`.

    HF's token-classification `score` has a bias; writing it as zeros keeps the function and loads cleanly.
    """
    head = catalog.tensors.get("output_layer.weight")
    if head is None or head.shape[0] != 1:
        raise MergerError(f"--is_value_model needs a 1-row output_layer.weight, found "
                          f"{head.shape if head else 'none'}, {catalog.root}")
    dtype = output_dtype(head.dtype, options.torch_dtype)
    return [Step((head.name,), (OutputSpec("score.weight", head.shape, dtype),)),
            Step((), (OutputSpec("score.bias", (1,), dtype),), _zero_bias)]


def megatron_steps(catalog: Catalog, config: dict, options: MergeOptions) -> list[Step]:
    table = _compile(FAMILIES[family_of(config)])
    tied = options.tie_word_embedding or ties_embeddings(config)
    steps = _value_head(catalog, options) if options.is_value_model else []
    for name, tensor in catalog.tensors.items():
        if name == "output_layer.weight" and (tied or options.is_value_model):
            continue  # tied: HF re-creates lm_head from the embedding; PP's last-stage copy is dropped here
        for pattern, kind, targets in table:
            m = pattern.fullmatch(name)
            if m:
                names = tuple(t.format(**m.groupdict()) for t in targets)
                steps.append(_step(name, tensor.shape, kind, names, config,
                                   output_dtype(tensor.dtype, options.torch_dtype)))
                break
        else:
            raise MergerError(f"no HF name for Megatron tensor {name} in the {family_of(config)} table, "
                              f"{catalog.root}")
    if not tied and not options.is_value_model and "output_layer.weight" not in catalog.tensors:
        raise MergerError(f"config.json has untied embeddings but the checkpoint has no output_layer.weight, "
                          f"{catalog.root}")
    return steps
