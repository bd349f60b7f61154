"""A Megatron torch_dist checkpoint holding the model's own shards and Megatron-Bridge LoRA adapter shards beside
them (verl's `use_dist_checkpointing` with `lora.*` and no HF export, or any save of a Megatron-Bridge PEFT model
that keeps the base).

The Megatron mapping writes the model; each adapted linear's step first adds (lora_alpha / r) * linear_out @
linear_in to the Megatron weight, in Megatron's layout, then applies the weight's own row transform
(`--lora separate`: the model as it is). The adapter goes beside as `lora_adapter/` under HF names, as
megatron_shards.py writes it; lora_alpha comes from --lora_alpha, r from the shapes.
"""
from __future__ import annotations

import dataclasses
import json
from functools import partial

import torch

from ...catalog import Catalog
from ...errors import MergerError
from ...options import MergeOptions
from ...sources.peft_adapter import CONFIG_FILE
from ...sources.verl_peft import is_adapter_shard
from .. import megatron
from ..hf import model_config
from ..steps import Mapping, Step, Transform
from .fold import fold_lora, lora_scale
from .megatron_shards import AdaptedLinear, adapted_linears, adapter_steps, peft_config, rank_and_alpha
from .peft_state import ADAPTER_DIR, ADAPTER_FILE, lora_note


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return (catalog.naming == "megatron" and catalog.format == "megatron_dist"
            and any(map(is_adapter_shard, catalog.tensors)))


def _fold(inputs: list[torch.Tensor], transform: Transform | None, scale: float) -> list[torch.Tensor]:
    weight, a, b = inputs
    folded = fold_lora(weight, a, b, scale, False)
    return [folded] if transform is None else transform([folded])


def _folded(step: Step, lin: AdaptedLinear, catalog: Catalog, scale: float) -> Step:
    """The base weight's step with the adapter added first: inputs weight, A, B."""
    weight = catalog.tensors[step.inputs[0]].shape
    a, b = catalog.tensors[lin.a].shape, catalog.tensors[lin.b].shape
    if (b[0], a[1]) != weight:
        raise MergerError(f"adapter shards {lin.a} {a} and {lin.b} {b} do not fit {step.inputs[0]} {weight}, "
                          f"{catalog.root}")
    return Step((step.inputs[0], lin.a, lin.b), step.outputs, partial(_fold, transform=step.transform, scale=scale))


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    _, model = model_config(catalog, options)
    where = catalog.details["checkpoint"]
    linears = adapted_linears(catalog, model, where, options)
    r, alpha = rank_and_alpha(catalog, linears, options, where)
    base = {n: t for n, t in catalog.tensors.items() if not is_adapter_shard(n)}
    mapping = megatron.build(dataclasses.replace(catalog, tensors=base), options)
    steps = mapping.steps
    if options.lora == "fuse":
        by_weight = {lin.linear + ".weight": lin for lin in linears}
        missing = set(by_weight) - {s.inputs[0] for s in steps if len(s.inputs) == 1}
        if missing:
            raise MergerError(f"adapter shards change {sorted(missing)[0]}, which the checkpoint lacks, {where}")
        scale = lora_scale(alpha, r, False)
        steps = [_folded(s, by_weight[s.inputs[0]], catalog, scale) if len(s.inputs) == 1 and s.inputs[0] in by_weight
                 else s for s in steps]
    outputs = [o.name for s in steps for o in s.outputs]
    config = peft_config(linears, catalog, model, outputs, r, alpha, options)
    modules = sum(len(lin.weights) for lin in linears)
    return dataclasses.replace(
        mapping, steps=steps + adapter_steps(catalog, linears, ADAPTER_FILE),
        extra_files={**mapping.extra_files, f"{ADAPTER_DIR}/{CONFIG_FILE}": json.dumps(config, indent=2) + "\n"},
        notes=(*mapping.notes, lora_note(config, modules, options.lora, "the Megatron weights")))
