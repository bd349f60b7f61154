"""A verl Megatron LoRA save whose adapter is only in Megatron-Bridge's shards (sources/verl_peft.py finds them).

Each adapted Megatron linear `<linear>` holds `adapter.linear_in.weight` [r, in] (LoRA's A) and
`adapter.linear_out.weight` [out, r] (B, its rows laid out as the base weight's rows), and adds
(lora_alpha / r) * B @ A to `<linear>.weight`. The shards record no lora_alpha: --lora_alpha gives it (verl keeps it
in its run config, `lora.alpha`), or --adapter_config (an adapter_config.json of this adapter); r is read off the
shapes.

The family record's Megatron row names the HF tensors `<linear>.weight` becomes and its kind's transform (q/k/v per
query group, fc1 into gate and up, or a rename). The transform only moves rows, so it splits B the same way, and the
adapter is a PEFT adapter on the HF modules: A shared, B split. With a base (`--base_model DIR`, else the weights
mbridge wrote into `model/huggingface/`) each HF weight gains scale * B_j @ A as fold.py folds PEFT adapters
(`--lora separate`: the base as it is), and that PEFT adapter is written beside as `lora_adapter/`; without one,
the target is the PEFT adapter folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch

from ...catalog import Catalog
from ...errors import MergerError
from ...options import MergeOptions
from ...sources.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from ...sources.verl_peft import SHARDS_FORMAT, adapter_linear, is_adapter_shard
from ..hf import model_config
from ..megatron import family_of, family_table, hf_names, transform_of
from ..steps import Mapping, OutputSpec, Step, Transform, cast
from .adapter import PEFT_PREFIX, config_from_tensors, describe, read_config_file
from .adapter_folders import base_folder, base_model_name, fold_into_base, open_base
from .adapter_state import ADAPTER_PART, adapter_folder_of
from .checkpoint_config import given_config_path, resolve_flag
from .fold import fold_lora, lora_scale
from .peft_state import ADAPTER_DIR, ADAPTER_FILE, lora_note
from .quantized_base import base_weights


@dataclass(frozen=True)
class AdaptedLinear:
    """One adapted Megatron linear: its A and B (catalog names), and the HF weights B's row transform feeds."""

    linear: str  # the Megatron linear, whose weight is `linear + ".weight"`
    a: str
    b: str
    transform: Transform | None  # None: B is the one HF module's B as it is
    weights: tuple[str, ...]  # HF weight names, in the transform's output order
    b_shapes: tuple[tuple[int, ...], ...]  # each one's part of B


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return catalog.format == SHARDS_FORMAT


def adapted_linears(catalog: Catalog, config: dict, where: str, options: MergeOptions) -> list[AdaptedLinear]:
    """Every adapted linear among the catalog's adapter shards; `where` names them in errors."""
    family = family_of(config, options)
    table = family_table(family)
    parts: dict[str, dict[str, str]] = {}
    for name in filter(is_adapter_shard, catalog.tensors):
        split = adapter_linear(name)
        if split is None:
            raise MergerError(f"adapter shard {name} is not a plain LoRA linear_in / linear_out weight (DoRA, "
                              f"canonical LoRA and adapter biases are not folded), {where}")
        parts.setdefault(split[0], {})[split[1]] = name
    found = []
    for linear, pair in sorted(parts.items()):
        if len(pair) != 2:
            have, lacks = ("linear_in", "linear_out") if "linear_in" in pair else ("linear_out", "linear_in")
            raise MergerError(f"adapter of {linear} has {have} but no {lacks} shard, {where}")
        a, b = catalog.tensors[pair["linear_in"]], catalog.tensors[pair["linear_out"]]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise MergerError(f"adapter shards {a.name} {a.shape} and {b.name} {b.shape} are not LoRA's [r, in] and "
                              f"[out, r], {where}")
        kind, names = hf_names(table, linear + ".weight", config.get("num_hidden_layers", 0), family, catalog)
        shapes, fn = transform_of(b.name, b.shape, kind, names, config, family)
        found.append(AdaptedLinear(linear, a.name, b.name, fn, names, tuple(shapes)))
    return found


def rank_and_alpha(catalog: Catalog, linears: list[AdaptedLinear], options: MergeOptions, where: str
                   ) -> tuple[int, float]:
    """r off the shapes; lora_alpha from --adapter_config (an adapter_config.json of this adapter, as
    Megatron-Bridge exports it) or --lora_alpha; a flag or config contradicting the shapes is an error."""
    ranks = sorted({catalog.tensors[lin.a].shape[0] for lin in linears})
    if len(ranks) != 1:
        raise MergerError(f"the adapter shards have several ranks {ranks}; Megatron-Bridge's LoRA has one, "
                          f"{where}")
    r, alpha = options.lora_r, options.lora_alpha
    if options.adapter_config is not None:
        path = given_config_path(options.adapter_config)
        config = read_config_file(path)
        if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise MergerError(f"{path.name} gives rsLoRA or per-module ranks or alphas, which Megatron-Bridge's LoRA "
                              f"does not have, {path}")
        r = resolve_flag(config["r"], r, "r", "--lora-r", path)
        alpha = resolve_flag(config["lora_alpha"], alpha, "lora_alpha", "--lora-alpha", path)
    if r is not None and r != ranks[0]:
        raise MergerError(f"r {r} (--lora_r or --adapter_config) disagrees with the adapter shards' rank {ranks[0]} "
                          f"(linear_in is [r, in]), {where}")
    if alpha is None:
        raise MergerError(f"the LoRA adapter shards record no lora_alpha and no HF PEFT export is beside them: pass "
                          f"--lora_alpha as used in training (verl's lora.alpha), or --adapter_config PATH, {where}")
    return ranks[0], float(alpha)


def _module(weight: str) -> str:
    return weight[: -len(".weight")]


def adapter_steps(catalog: Catalog, linears: list[AdaptedLinear], file: str, prefix: str = "") -> list[Step]:
    """The adapter under PEFT's names for the HF model: per HF module, A as saved and its part of B."""
    steps = []
    for lin in linears:
        a, b = catalog.tensors[lin.a], catalog.tensors[lin.b]
        for weight in lin.weights:
            steps.append(cast(prefix + lin.a, f"{PEFT_PREFIX}{_module(weight)}.lora_A.weight", a.shape, a.dtype, file))
        outputs = tuple(OutputSpec(f"{PEFT_PREFIX}{_module(w)}.lora_B.weight", s, b.dtype, file)
                        for w, s in zip(lin.weights, lin.b_shapes))
        steps.append(Step((prefix + lin.b,), outputs, lin.transform))
    return steps


def _fold(inputs: list[torch.Tensor], transform: Transform | None, index: int, scale: float) -> list[torch.Tensor]:
    weight, a, b = inputs
    part = b if transform is None else transform([b])[index]
    return [fold_lora(weight, a, part, scale, False)]


def fold_steps(base: Catalog, catalog: Catalog, linears: list[AdaptedLinear], scale: float) -> list[Step]:
    """One step per adapted HF weight: the base weight (as the fold reads it: a quantized one dequantized), A and the
    whole B in; the folded weight out."""
    steps = []
    weights = base_weights(base).tensors
    for lin in linears:
        in_features = catalog.tensors[lin.a].shape[1]
        for index, (weight, b_shape) in enumerate(zip(lin.weights, lin.b_shapes)):
            tensor = weights.get(weight)
            if tensor is None:
                raise MergerError(f"adapter shard {lin.b} changes {weight}, which the base model lacks, {base.root}")
            if tensor.shape != (b_shape[0], in_features):
                raise MergerError(f"adapter shards of {lin.b} make a [{b_shape[0]}, {in_features}] change to {weight}, "
                                  f"which is {list(tensor.shape)} in the base model, {base.root}")
            steps.append(Step((weight, ADAPTER_PART + lin.a, ADAPTER_PART + lin.b),
                              (OutputSpec(weight, tensor.shape, tensor.dtype),),
                              partial(_fold, transform=lin.transform, index=index, scale=scale)))
    return steps


def peft_config(linears: list[AdaptedLinear], catalog: Catalog, model: dict, base: Iterable[str] | None, r: int,
                alpha: float, options: MergeOptions) -> dict:
    """adapter_config.json of the adapter under HF names; `base` (the HF model's tensor names), when known, lets
    it target leaf names (`q_proj`)."""
    shapes = {}
    for lin in linears:
        for weight, b_shape in zip(lin.weights, lin.b_shapes):
            shapes[f"{_module(weight)}.lora_A.weight"] = catalog.tensors[lin.a].shape
            shapes[f"{_module(weight)}.lora_B.weight"] = b_shape
    config = config_from_tensors({k: k for k in shapes}, shapes, model,
                                 None if base is None else {n: n for n in base}, r, alpha, {})
    config["base_model_name_or_path"] = (base_model_name(options.base_model) if options.base_model is not None
                                         else model.get("_name_or_path"))
    return config


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, model = model_config(catalog, options)
    where = catalog.details["adapter shards"]
    linears = adapted_linears(catalog, model, where, options)
    r, alpha = rank_and_alpha(catalog, linears, options, where)
    modules = sum(len(lin.weights) for lin in linears)
    base_dir = base_folder(catalog, options)
    if base_dir is None:
        config = peft_config(linears, catalog, model, None, r, alpha, options)
        note = (f"merger: verl Megatron LoRA shards without base weights ({describe(config, modules)}, from "
                f"{where}): the target is a PEFT adapter folder with HF module names (--base_model DIR, "
                f"the model the run started from, folds it in)")
        return adapter_folder_of(adapter_steps(catalog, linears, WEIGHTS_FILE), config, options, where,
                                 (note,))
    base = open_base(base_dir)
    config = peft_config(linears, catalog, model, base.tensors, r, alpha, options)
    folds = fold_steps(base, catalog, linears, lora_scale(alpha, r, False)) if options.lora == "fuse" else []
    return fold_into_base(base, {ADAPTER_PART: catalog}, [], options, f"hf_safetensors+{catalog.format}",
                          tuple(adapter_steps(catalog, linears, ADAPTER_FILE, ADAPTER_PART)),
                          {f"{ADAPTER_DIR}/{CONFIG_FILE}": json.dumps(config, indent=2) + "\n"},
                          (lora_note(config, modules, options.lora, f"the base model {base.root}"),),
                          folds=tuple(folds))
