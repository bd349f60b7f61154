"""Megatron checkpoints (catalog naming "megatron"): the steps from the model family's table
(megatron_families.py), with the transforms each row's kind names, verl's critic value head, and
multi-token-prediction layers (written after the decoder layers, or left out with --drop-mtp)."""
from __future__ import annotations

import re
from functools import partial

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from . import megatron_transforms as tf
from .hf import model_config
from .megatron_families import CONFIG_ROWS, FAMILIES, GLOBAL, MTP, MTP_FAMILIES, MTP_SHARED, MTP_TRANSFORMER_LAYER
from .policy import ties
from .steps import Mapping, OutputSpec, Step, Transform, cast

MTP_PREFIX = "mtp."


def _compile(rows) -> list[tuple[re.Pattern, str, tuple[str, ...]]]:
    """Patterns for global and layer tensors; an MTP layer's tensors match with `j`, its MTP layer number."""
    def pattern(suffix: str) -> str:
        return re.escape(suffix).replace(r"\{e\}", r"(?P<e>\d+)")

    out = [(re.compile(pattern(src)), kind, dst) for src, kind, dst in GLOBAL]
    inner = "|".join(MTP_TRANSFORMER_LAYER)
    for src, kind, dst in rows:
        layer_dst = tuple("model.layers.{i}." + d for d in dst)
        out.append((re.compile(r"decoder\.layers\.(?P<i>\d+)\." + pattern(src)), kind, layer_dst))
        out.append((re.compile(rf"mtp\.layers\.(?P<j>\d+)\.(?:{inner})\." + pattern(src)), kind, layer_dst))
    for src, kind, dst in MTP:
        out.append((re.compile(r"mtp\.layers\.(?P<j>\d+)\." + pattern(src)), kind,
                    tuple("model.layers.{i}." + d for d in dst)))
    return out


def family_of(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise MergerError(f"no Megatron mapping for model_type {model_type!r} (known: {', '.join(FAMILIES)}), "
                          f"config.json")
    return model_type


def transform_of(name: str, shape: tuple[int, ...], kind: str, targets: tuple[str, ...], config: dict
                 ) -> tuple[list[tuple[int, ...]], Transform | None]:
    """The shapes of the HF tensors Megatron tensor `name` becomes under its row's `kind`, and the transform
    (None: a rename). Row-wise, so it applies as well to anything laid out as that tensor's rows (a LoRA B)."""
    if kind == "qkv":
        heads = config["num_attention_heads"]
        groups = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return tf.qkv_shapes(shape, heads, groups, head_dim, name), partial(
            tf.split_qkv, heads=heads, groups=groups, head_dim=head_dim)
    if kind == "gate_up":
        return tf.gate_up_shapes(shape, name), tf.split_gate_up
    if kind == "vocab":
        vocab = config["vocab_size"]
        shapes = tf.vocab_shapes(shape, vocab, name)
        # no padding rows: a rename (a plain cast, which each rank places where it reads it)
        return shapes, None if shapes[0] == shape else partial(tf.unpad_vocab, vocab=vocab)
    rows = CONFIG_ROWS.get(targets[0].split(".", 3)[-1])
    if rows is not None and shape[0] != rows(config):
        raise MergerError(f"tensor {name} has {shape[0]} rows where config.json needs {rows(config)} for "
                          f"{targets[0]} (a TP layout read wrong, or another model's config?), config.json")
    return [shape], None


def _step(name: str, shape: tuple[int, ...], kind: str, targets: tuple[str, ...], config: dict,
          dtype) -> Step:
    shapes, fn = transform_of(name, shape, kind, targets, config)
    if fn is None:
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


def _mtp_layers(catalog: Catalog, family: str, options: MergeOptions) -> list[int]:
    """The MTP layer numbers to write: none with --drop-mtp; an error for a family HF has no MTP layers for,
    so a checkpoint's layers are never left out unasked."""
    names = [n for n in catalog.tensors if n.startswith(MTP_PREFIX)]
    if not names or options.drop_mtp:
        return []
    if family not in MTP_FAMILIES:
        raise MergerError(f"Megatron tensor {names[0]} belongs to a multi-token-prediction layer, which the {family} "
                          f"family has no HF names for (pass --drop-mtp to leave MTP layers out), {catalog.root}")
    return sorted({int(n.split(".")[2]) for n in names})


def _mtp_note(catalog: Catalog, mtp: list[int], first: int) -> tuple[str, ...]:
    """The log line saying what became of the checkpoint's MTP layers."""
    held = {n.split(".")[2] for n in catalog.tensors if n.startswith(MTP_PREFIX)}
    if mtp:
        return (f"merger: {len(mtp)} multi-token-prediction layer(s) written as model.layers.{first}"
                f"{f'-{first + len(mtp) - 1}' if len(mtp) > 1 else ''} (--drop-mtp leaves them out)",)
    return (f"merger: {len(held)} multi-token-prediction layer(s) left out (--drop-mtp)",) if held else ()


def _mtp_shared(catalog: Catalog, config: dict, layer: int) -> list[Step]:
    """The embedding and output layer again, as MTP layer `layer`'s own (DeepSeek-V3's checkpoints hold them)."""
    steps = []
    for src, kind, (dst,) in MTP_SHARED:
        tensor = catalog.tensors.get(src) or catalog.tensors.get(MTP_SHARED[0][0])  # tied: the embedding
        if tensor is not None:
            steps.append(_step(tensor.name, tensor.shape, kind, (f"model.layers.{layer}.{dst}",), config, tensor.dtype))
    return steps


def family_table(family: str) -> list[tuple[re.Pattern, str, tuple[str, ...]]]:
    return _compile(FAMILIES[family])


def hf_names(table, name: str, first_mtp: int, family: str, catalog: Catalog) -> tuple[str, tuple[str, ...]]:
    """The kind of Megatron tensor `name`'s row and the HF names it becomes (MTP layer j is HF layer
    first_mtp + j)."""
    for pattern, kind, targets in table:
        m = pattern.fullmatch(name)
        if m:
            groups = m.groupdict()
            if groups.get("j") is not None:
                groups["i"] = first_mtp + int(groups.pop("j"))
            return kind, tuple(t.format(**groups) for t in targets)
    raise MergerError(f"no HF name for Megatron tensor {name} in the {family} table, {catalog.root}")


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    family = family_of(config)
    table = family_table(family)
    mtp = _mtp_layers(catalog, family, options)
    first_mtp = config.get("num_hidden_layers", 0)
    if mtp:
        decoder = {int(n.split(".")[2]) for n in catalog.tensors if n.startswith("decoder.layers.")}
        if len(decoder) != first_mtp:
            raise MergerError(f"the checkpoint has {len(decoder)} decoder layers but config.json's num_hidden_layers "
                              f"is {first_mtp}, so its MTP layers would be misnumbered, {catalog.root}")
    steps = _value_head(catalog, options) if options.is_value_model else []
    for name, tensor in catalog.tensors.items():
        if name == "output_layer.weight" and options.is_value_model:
            continue  # the value head, above
        if name.startswith(MTP_PREFIX) and not mtp:
            continue  # --drop-mtp
        kind, names = hf_names(table, name, first_mtp, family, catalog)
        steps.append(_step(name, tensor.shape, kind, names, config, tensor.dtype))
    for j in mtp:
        steps += _mtp_shared(catalog, config, first_mtp + j)
    # Tied: HF re-creates lm_head from the embedding, and the policy drops PP's last-stage copy.
    if not ties(config, options) and not options.is_value_model and "output_layer.weight" not in catalog.tensors:
        raise MergerError(f"config.json has untied embeddings but the checkpoint has no output_layer.weight, "
                          f"{catalog.root}")
    updates = {"num_nextn_predict_layers": len(mtp)} if family in MTP_FAMILIES else {}
    return Mapping(steps, hf_dir, config, config_updates=updates, notes=_mtp_note(catalog, mtp, first_mtp))
