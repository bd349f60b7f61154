"""Megatron checkpoints (catalog naming "megatron"): the steps from the model family's table
(megatron_families.py), with the transforms each row's kind names, and verl's critic value head."""
from __future__ import annotations

import re
from functools import partial

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from . import megatron_transforms as tf
from .hf import model_config
from .megatron_families import FAMILIES, GLOBAL
from .policy import ties
from .steps import Mapping, OutputSpec, Step, cast

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
        return cast(name, targets[0], shape, dtype)
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
    return [cast(head.name, "score.weight", head.shape, head.dtype),
            Step((), (OutputSpec("score.bias", (1,), head.dtype),), _zero_bias)]


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return catalog.naming == "megatron"


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    table = _compile(FAMILIES[family_of(config)])
    steps = _value_head(catalog, options) if options.is_value_model else []
    for name, tensor in catalog.tensors.items():
        if name == "output_layer.weight" and options.is_value_model:
            continue  # the value head, above
        for pattern, kind, targets in table:
            m = pattern.fullmatch(name)
            if m:
                names = tuple(t.format(**m.groupdict()) for t in targets)
                steps.append(_step(name, tensor.shape, kind, names, config, tensor.dtype))
                break
        else:
            raise MergerError(f"no HF name for Megatron tensor {name} in the {family_of(config)} table, "
                              f"{catalog.root}")
    # Tied: HF re-creates lm_head from the embedding, and the policy drops PP's last-stage copy.
    if not ties(config, options) and not options.is_value_model and "output_layer.weight" not in catalog.tensors:
        raise MergerError(f"config.json has untied embeddings but the checkpoint has no output_layer.weight, "
                          f"{catalog.root}")
    return Mapping(steps, hf_dir, config)
