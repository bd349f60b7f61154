"""Megatron checkpoints (catalog naming "megatron"): the steps from the model family's record (families.py, chosen
by config.json's model_type, or a family file's with --family: family_file.py) under Megatron's naming (megatron_rows.py), with the transform each row's kind names
(kinds.py), verl's critic value head, and multi-token-prediction layers (mtp.py: written after the decoder
layers, or left out with --drop-mtp)."""
from __future__ import annotations

import re

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from . import kinds, mtp
from .families import MEGATRON_FAMILIES as FAMILIES
from .families import megatron_family
from .family import Family, Row
from .family_file import misspelt_row, read_family
from .hf import model_config
from .megatron_rows import MEGATRON
from .megatron_unbuildable import UNBUILDABLE
from .naming import Entry, compile_table, lookup
from .policy import ties
from .steps import Mapping, OutputSpec, Step, Transform, cast
from .transformers_release import require_model_type


EXPERT = re.compile(r"\.local_experts\.(\d+)\.")  # the catalog's name of every expert, whichever module saved it


def _vlm_of(model_type: str) -> Family | None:
    """The family whose text model HF VLM `model_type` wraps (Qwen3.5's qwen3_5, Kimi-K2.5's kimi_k25)."""
    return next((f for f in FAMILIES if model_type in f.vlm_types()), None)


def _file_family(config: dict, options: MergeOptions) -> Family | None:
    """The family of --family FILE, which replaces the built-in one for the model types it names; None without it."""
    if options.family is None:
        return None
    family = read_family(options.family)
    model_type = config.get("model_type")
    if model_type not in family.model_types:
        raise MergerError(f"the family file maps model types {', '.join(family.model_types)}, but config.json has "
                          f"model_type {model_type!r} (--hf_model_config_path gives the config of the model to "
                          f"write), {options.family}")
    require_model_type(model_type, "config.json")
    return family


def family_of(config: dict, options: MergeOptions) -> Family:
    if (given := _file_family(config, options)) is not None:
        return given
    model_type = config.get("model_type")
    family = megatron_family(model_type)
    vlm = family or _vlm_of(model_type)
    if vlm is not None and vlm.vlm_only:
        raise MergerError(f"the Megatron checkpoint holds no vision tower (vision_model.*), and merger writes the "
                          f"{vlm.name} family only as HF {' or '.join(vlm.megatron_vision.model_types)} with it: "
                          f"transformers has no causal LM of {' or '.join(vlm.model_types)} alone, config.json")
    if family is None and (text := _vlm_of(model_type)):
        raise MergerError(f"Megatron checkpoints of {text.name} are written as the text model of HF {model_type}: "
                          f"pass a folder whose config.json is this config's text_config, its model_type "
                          f"{' or '.join(text.model_types)} (a VLM's text_config may name its own, as qwen3_vl_text), "
                          f"with --hf_model_config_path, config.json")
    if family is None and (why := UNBUILDABLE.get(model_type)):
        raise MergerError(f"no Megatron mapping for model_type {model_type!r}: {why} (docs/megatron.md), config.json")
    if family is None:
        known = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise MergerError(f"no Megatron mapping for model_type {model_type!r} (known: {known}), config.json")
    require_model_type(model_type, "config.json")
    return family


def _check_config_rows(name: str, shape: tuple[int, ...], targets: tuple[str, ...], config: dict,
                       family: Family) -> None:
    rows = family.config_rows.get(targets[0].split(".", 3)[-1])
    if rows is not None and shape[0] != rows(config):
        raise MergerError(f"tensor {name} has {shape[0]} rows where config.json needs {rows(config)} for "
                          f"{targets[0]} (a TP layout read wrong, or another model's config?), config.json")


def transform_of(name: str, shape: tuple[int, ...], kind: str, targets: tuple[str, ...], config: dict,
                 family: Family) -> tuple[list[tuple[int, ...]], Transform | None]:
    """The shapes of the HF tensors Megatron tensor `name` becomes under its row's `kind`, and the transform
    (None: a rename). Row-wise, so it applies as well to anything laid out as that tensor's rows (a LoRA B)."""
    _check_config_rows(name, shape, targets, config, family)
    return kinds.KINDS[kind].plan(name, shape, config)


def _step(name: str, shape: tuple[int, ...], kind: str, targets: tuple[str, ...], config: dict, dtype,
          family: Family) -> Step:
    _check_config_rows(name, shape, targets, config, family)
    return kinds.step(name, shape, dtype, kind, targets, config)


def check_layer_types(catalog: Catalog, config: dict, family: Family, prefix: str = "") -> None:
    """A hybrid's layers (their names after `prefix`: a VLM's text model's `language_model.`) are of the types
    config.json's `layer_types` gives (its text_config's, for a VLM), which decide HF's modules."""
    if not family.layer_types:
        return
    types = config.get("layer_types")
    if not isinstance(types, list):
        raise MergerError(f"config.json has no layer_types, which a {family.name} model needs (the HF config of the "
                          f"model, --hf_model_config_path), {catalog.root}")
    for i, wanted in enumerate(types):
        held = [t for t, row in family.layer_types.items()
                if f"{prefix}{MEGATRON.decoder}{i}.{row}" in catalog.tensors]
        if held != [wanted]:
            raise MergerError(f"layer {i} of the checkpoint is {' and '.join(held) or 'of no known type'} but "
                              f"config.json's layer_types[{i}] is {wanted!r}, {catalog.root}")


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


def mtp_note(catalog: Catalog, family: Family, layers: list[int], first: int, prefix: str = "") -> tuple[str, ...]:
    """The log line saying what became of the checkpoint's MTP layers (named after `prefix`)."""
    start = prefix + MEGATRON.mtp.prefix
    held = {n[len(start):].split(".")[0] for n in catalog.tensors if n.startswith(start)}
    if layers:
        return (f"merger: {len(layers)} multi-token-prediction layer(s) written as "
                f"{mtp.where(family, layers, first)} (--drop-mtp leaves them out)",)
    return (f"merger: {len(held)} multi-token-prediction layer(s) left out (--drop-mtp)",) if held else ()


def family_table(family: Family) -> list[Entry]:
    return compile_table(MEGATRON, family.megatron, family.mtp)


def _unmapped_in_file(table: list[Entry], name: str, family: Family, catalog: Catalog) -> MergerError:
    """A tensor no row of a family file maps, and the row misspelt for it (it matches nothing) where there is one."""
    unmatched = misspelt_row(family, table, catalog.tensors, name)
    if unmatched is None:
        return MergerError(f"Megatron tensor {name} of {catalog.root} matches no row of the family file (layer rows "
                           f"are named after {MEGATRON.decoder}{{i}}.), {family.file}")
    row, expected = unmatched
    return MergerError(f"row {row.source!r} of the family file matches no tensor of the checkpoint (it expects one "
                       f"named like {expected}), and Megatron tensor {name} of {catalog.root} has no row, "
                       f"{family.file}")


def row_of(table: list[Entry], name: str, first_mtp: int, family: Family, catalog: Catalog
           ) -> tuple[Row, tuple[str, ...]]:
    """The row of Megatron tensor `name` and the HF names it becomes (MTP layer j is HF layer first_mtp + j)."""
    found = lookup(table, name, first_mtp)
    if found is None and family.file:
        raise _unmapped_in_file(table, name, family, catalog)
    if found is None:
        raise MergerError(f"no HF name for Megatron tensor {name} in the {family.name} table, {catalog.root}")
    row, targets = found
    return row, tuple(family.hf_name(t) for t in targets)


def hf_names(table: list[Entry], name: str, first_mtp: int, family: Family, catalog: Catalog
             ) -> tuple[str, tuple[str, ...]]:
    """The kind of the row of a Megatron linear `name` written on its own (a LoRA's base), and its HF names."""
    row, targets = row_of(table, name, first_mtp, family, catalog)
    if row.stacked:
        raise MergerError(f"Megatron tensor {name} is written stacked with the other experts' as {targets[0]}: "
                          f"an adapter on it is not folded, {catalog.root}")
    return row.kind, targets


def _stacked_steps(target: str, experts: dict[int, str], row: Row, catalog: Catalog, config: dict) -> list[Step]:
    """One HF tensor [E, ...] from every expert's `row` tensor in expert order, under the row's kind, a step per
    expert (kinds.stacked_steps)."""
    names = [experts[e] for e in sorted(experts)]
    count = config.get("num_local_experts", len(experts))
    if sorted(experts) != list(range(count)):
        raise MergerError(f"{target} stacks config.json's {count} experts (num_local_experts), but the checkpoint "
                          f"holds experts {sorted(experts)}, {catalog.root}")
    shapes = {catalog.tensors[n].shape for n in names}
    if len(shapes) != 1:
        raise MergerError(f"the experts written as {target} differ in shape ({sorted(shapes)}), {catalog.root}")
    stack = (len(names), *shapes.pop())
    return kinds.stacked_steps(names, stack, catalog.tensors[names[0]].dtype, row.kind, target, config)


class ExpertStacks:
    """The experts' tensors of `stacked` rows, gathered by the HF tensor they are written into as one [E, ...]."""

    def __init__(self):
        self.stacks: dict[str, tuple[Row, dict[int, str]]] = {}  # HF name -> the row and its experts' tensors

    def add(self, row: Row, target: str, name: str) -> None:
        self.stacks.setdefault(target, (row, {}))[1][int(EXPERT.search(name).group(1))] = name

    def steps(self, catalog: Catalog, config: dict) -> list[Step]:
        return [step for target, (row, experts) in self.stacks.items()
                for step in _stacked_steps(target, experts, row, catalog, config)]


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    family = family_of(config, options)
    check_layer_types(catalog, config, family)
    table = family_table(family)
    layers = mtp.mtp_layers(catalog, MEGATRON, family, config, options)
    first_mtp = config.get("num_hidden_layers", 0)
    steps = _value_head(catalog, options) if options.is_value_model else []
    stacks = ExpertStacks()
    for name, tensor in catalog.tensors.items():
        if name == "output_layer.weight" and options.is_value_model:
            continue  # the value head, above
        if name.startswith(MEGATRON.mtp.prefix) and not layers:
            continue  # --drop-mtp
        row, names = row_of(table, name, first_mtp, family, catalog)
        if row.stacked:
            stacks.add(row, names[0], name)
            continue
        try:
            steps.append(_step(name, tensor.shape, row.kind, names, config, tensor.dtype, family))
        except MergerError as e:
            if not family.file:
                raise
            raise MergerError(f"row {row.source!r} of the family file does not fit the checkpoint: {e}, "
                              f"{family.file}") from e
    steps += stacks.steps(catalog, config)
    steps += mtp.shared_steps(catalog, MEGATRON, family, config, layers)
    # Tied: HF re-creates lm_head from the embedding, and the policy drops PP's last-stage copy.
    if not ties(config, options) and not options.is_value_model and "output_layer.weight" not in catalog.tensors:
        raise MergerError(f"config.json has untied embeddings but the checkpoint has no output_layer.weight, "
                          f"{catalog.root}")
    return Mapping(steps, hf_dir, config, config_updates=mtp.count_update(family, layers),
                   notes=mtp_note(catalog, family, layers, first_mtp))
