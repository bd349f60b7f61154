"""Megatron vision-language checkpoints (Megatron-Bridge's and verl's Megatron engine's: the text model as a GPTModel
under `language_model.`, the vision tower beside it, under `vision_model.` or, kept as HF's own module, `visual.`)
as the HF VLM, whole.

The VLM is found from config.json's model_type among the families' Megatron vision towers (family.megatron_vision:
Qwen3-VL's qwen3_vl and qwen3_vl_moe, Qwen3.5's qwen3_5 and qwen3_5_moe, GLM-4.5V's glm4v_moe). The text model's
tensors are the family's Megatron rows, mapped with config.json's `text_config` (its heads, its vocabulary; a
hybrid's layer_types, checked against the layers) and written under the VLM's names
(`model.language_model.`, `lm_head`; experts stacked where a row says so, as megatron.py writes them);
the tower's are the tower's rows, mapped with the whole config.json (its `vision_config`). A text model's
multi-token-prediction layers are written where the family's HF layout keeps them outside the model (Qwen3.5's
`mtp.*`, counted in text_config), refused for the others, left out with --drop-mtp.
"""
from __future__ import annotations

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from ..sources.megatron_dist import VLM_PREFIXES
from . import kinds, mtp
from .families import MEGATRON_FAMILIES
from .family import Family, VisionTower
from .hf import model_config
from .megatron import ExpertStacks, check_layer_types, family_table, mtp_note, row_of
from .megatron_rows import MEGATRON
from .naming import lookup, tower_table
from .policy import ties
from .steps import Mapping
from .transformers_release import require_model_type

TEXT = VLM_PREFIXES[0]
TOWERS = tuple((f, f.megatron_vision) for f in MEGATRON_FAMILIES if f.megatron_vision)
# what only a VLM's checkpoint holds: its text model's prefix, or a tower's
VLM_STARTS = (TEXT, *sorted({t.prefix for _, t in TOWERS}))


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return catalog.naming == "megatron" and any(n.startswith(VLM_STARTS) for n in catalog.tensors)


def _family(config: dict, catalog: Catalog) -> tuple[Family, VisionTower]:
    model_type = config.get("model_type")
    found = next(((f, t) for f, t in TOWERS if model_type in t.model_types), None)
    if found is None:
        known = ", ".join(m for _, t in TOWERS for m in t.model_types)
        raise MergerError(f"a Megatron vision-language checkpoint ({TEXT}* tensors and a vision tower's) with "
                          f"config.json model_type {model_type!r}: merger writes Megatron VLMs as {known} "
                          f"(docs/megatron.md; --hf_model_config_path gives the HF VLM's config), {catalog.root}")
    if not any(n.startswith(found[1].prefix) for n in catalog.tensors):
        raise MergerError(f"the Megatron checkpoint holds no vision tower ({found[1].prefix}*), which HF {model_type} "
                          f"is written with, {catalog.root}")
    if not isinstance(config.get("text_config"), dict):
        raise MergerError(f"config.json of HF {model_type} has no text_config, which the text model is mapped by "
                          f"(the HF config of the model, --hf_model_config_path), {catalog.root}")
    require_model_type(model_type, "config.json")
    return found


def _beside_vlm(family: Family) -> bool:
    """The family's HF layout keeps its MTP layers outside the model (Qwen3.5's `mtp.*`, where its VLM release holds
    them): a VLM can hold them. A DeepSeek-style layer repeats the embedding as `model.layers.{L+j}` of a text model
    the VLM keeps elsewhere: no VLM has a place for it."""
    return family.mtp is not None and not family.mtp.shared


def _mtp_layers(catalog: Catalog, config: dict, family: Family, options: MergeOptions) -> list[int]:
    """The text model's MTP layers to write beside the VLM; those no VLM has a place for are refused unless
    --drop-mtp leaves them out."""
    held = next((n for n in catalog.tensors if n.startswith(TEXT + MEGATRON.mtp.prefix)), None)
    if held is None or options.drop_mtp:
        return []
    if not _beside_vlm(family):
        raise MergerError(f"Megatron tensor {held} is a multi-token-prediction layer's, which HF "
                          f"{config['model_type']} has no place for (pass --drop-mtp to leave MTP layers out), "
                          f"{catalog.root}")
    return mtp.mtp_layers(catalog, MEGATRON, family, config["text_config"], options, TEXT)


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    family, tower = _family(config, catalog)
    text_config = config["text_config"]
    check_layer_types(catalog, text_config, family, TEXT)
    text_table, vision_table = family_table(family), tower_table(tower, "Megatron vision")
    layers, first_mtp = _mtp_layers(catalog, config, family, options), text_config.get("num_hidden_layers", 0)
    steps, stacks = [], ExpertStacks()
    for name, t in catalog.tensors.items():
        if name.startswith(TEXT + MEGATRON.mtp.prefix) and not layers:
            continue  # --drop-mtp
        if name.startswith(TEXT):
            row, targets = row_of(text_table, name[len(TEXT):], first_mtp, family, catalog)
            targets = tuple(map(tower.text_name, targets))
            if row.stacked:
                stacks.add(row, targets[0], name)
            else:
                steps.append(kinds.step(name, t.shape, t.dtype, row.kind, targets, text_config))
            continue
        found = lookup(vision_table, name, 0) if name.startswith(tower.prefix) else None
        if found is None:
            raise MergerError(f"no HF name for Megatron tensor {name} in the {family.name} family's HF "
                              f"{config['model_type']} table ({TEXT}*, {tower.prefix}*), {catalog.root}")
        row, targets = found
        steps.append(kinds.step(name, t.shape, t.dtype, row.kind, targets, config))
    steps += stacks.steps(catalog, text_config)
    # Tied: HF re-creates lm_head from the embedding
    if not ties(config, options) and f"{TEXT}output_layer.weight" not in catalog.tensors:
        raise MergerError(f"config.json has untied embeddings but the checkpoint has no "
                          f"{TEXT}output_layer.weight, {catalog.root}")
    # the MTP layer count is the text model's (text_config's mtp_num_hidden_layers): config.json's whole text_config
    # is set again with it
    counted = mtp.count_update(family, layers) if _beside_vlm(family) else {}
    return Mapping(steps, hf_dir, config, config_updates={"text_config": {**text_config, **counted}} if counted else {},
                   notes=(f"merger: Megatron {family.name} VLM names, written as HF {config['model_type']} with its "
                          f"vision tower", *mtp_note(catalog, family, layers, first_mtp, TEXT)))
