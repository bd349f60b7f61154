"""torchtitan checkpoints (the DCP folders torchtitan and verl's torchtitan engine save) to HF names, through the
model family's record (families.py) under torchtitan's naming (torchtitan_rows.py).

The family is found from the names: the one whose marks (layer names only its rows hold) the checkpoint holds, or
the one family without marks (llama) when none does; or `--model torchtitan-<family>` says it. A MoE layer's
routed experts are stacked tensors ([E, F, D]); each expert's part is read on its own (sources/unstacked.py) and
written under the per-expert names transformers saves. The head counts and the architecture come from the HF
config, which a torchtitan checkpoint lacks: pass `--hf_model_config_path` with the config.json of the HF model
to produce. A torchtitan VLM (Qwen3.5, Kimi-K2.5 / K2.7) is written whole, its vision tower too, where config.json
is the HF VLM's (qwen3_5, qwen3_5_moe, kimi_k25); where it is the text model's, the tower is left out and counted
in the note. A VLM's config.json for a checkpoint without the tower is refused, naming its text_config.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import partial

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from ..sources.unstacked import unstacked
from . import kinds, mtp
from .families import TORCHTITAN_FAMILIES as FAMILIES
from .families import TORCHTITAN_UNMARKED
from .family import Family, Row, VisionTower
from .hf import model_config
from .naming import compile_table, lookup, tower_table
from .steps import Mapping, cast
from .torchtitan_rows import DROPPED_BUFFERS, TORCHTITAN
from .transformers_release import require_model_type

MODELS = {f"torchtitan-{f.name.replace('_', '-')}": f for f in FAMILIES}  # the --model values
_LAYER_ROW = re.compile(r"layers\.\d+\.(.*)")


def looks_like_torchtitan(names) -> bool:
    return any(n == "tok_embeddings.weight" or re.fullmatch(
        r"layers\.\d+\.(attention\.(qkv_linear\.)?wq|attn\.(wq|in_proj_q))\.weight", n) for n in names)


def family_of(names, root) -> Family:
    """The family whose marks the decoder layers hold; without any, the one family that has no marks."""
    held = {m[1] for n in names if (m := _LAYER_ROW.fullmatch(n))}
    marked = [f for f in FAMILIES if held.intersection(f.torchtitan_marks)]
    if len(marked) > 1:
        raise MergerError(f"the torchtitan names hold marks of the {' and '.join(f.name for f in marked)} families "
                          f"(--model names the family), {root}")
    return marked[0] if marked else TORCHTITAN_UNMARKED


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """The names look like torchtitan's, or --model names a torchtitan family."""
    if options.model == "auto":
        return looks_like_torchtitan(catalog.tensors)
    return options.model in MODELS


def _vision(family: Family, config: dict) -> VisionTower | None:
    """The family's vision tower where config.json is one of its HF VLMs, else None."""
    tower = family.torchtitan_vision
    return tower if tower and config.get("model_type") in tower.model_types else None


def _checked_config(family: Family, config: dict, hf_dir, names, options: MergeOptions) -> None:
    vision = _vision(family, config)
    if vision and not options.drop_mtp and any(n.startswith(TORCHTITAN.mtp.prefix) for n in names):
        raise MergerError(f"the torchtitan checkpoint holds multi-token-prediction layers, which are written with the "
                          f"text model's config.json, not HF {config['model_type']}'s (pass --drop-mtp to leave them "
                          f"out, or this config's text_config with --hf_model_config_path), {hf_dir / 'config.json'}")
    if vision and not any(n.startswith(vision.prefix) for n in names):
        raise MergerError(f"config.json is HF {config['model_type']}, a VLM, but the torchtitan checkpoint holds no "
                          f"vision tower ({vision.prefix}*): pass a folder whose config.json is this config's "
                          f"text_config (model_type {' or '.join(family.model_types)}) with --hf_model_config_path, "
                          f"{hf_dir / 'config.json'}")
    if not vision and not family.torchtitan_any_config and config.get("model_type") not in family.model_types:
        raise MergerError(f"torchtitan {family.name} names, but config.json has model_type "
                          f"{config.get('model_type')!r} (expected {' or '.join(family.model_types)}): pass the HF "
                          f"config of this model with --hf_model_config_path, {hf_dir / 'config.json'}")


def _parts(catalog: Catalog, name: str, row: Row) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The tensors of `name`'s layer that its row joins to it, with their shapes."""
    parts = []
    for part in (name.replace(row.source, j) for j in row.joined):
        if part not in catalog.tensors:
            raise MergerError(f"tensor {name} is written with {part}, which the checkpoint lacks, {catalog.root}")
        parts.append((part, catalog.tensors[part].shape))
    return tuple(parts)


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    family = MODELS.get(options.model) or family_of(catalog.tensors, catalog.root)
    hf_dir, config = model_config(catalog, options)
    _checked_config(family, config, hf_dir, catalog.tensors, options)
    require_model_type(config.get("model_type"), hf_dir / "config.json")
    table = compile_table(TORCHTITAN, family.torchtitan, family.mtp)
    vision = _vision(family, config)
    vision_table = tower_table(vision, "torchtitan vision") if vision else None
    layers = mtp.mtp_layers(catalog, TORCHTITAN, family, config, options)
    steps, stacks, skipped, left_out = [], {}, [], Counter()
    kept_stacked = 0  # of the stacks, those HF keeps stacked too
    for name, t in catalog.tensors.items():
        if any(name == b or name.endswith("." + b) for b in DROPPED_BUFFERS):
            continue  # recomputed by HF, never a weight
        if name.startswith(TORCHTITAN.mtp.prefix) and not layers:
            continue  # --drop-mtp
        in_tower = vision is not None and name.startswith(vision.prefix)
        outside = next((part for part in family.torchtitan_left_out if name.startswith(part[0])), None)
        if outside and not in_tower:
            left_out[outside] += 1
            continue
        found = lookup(vision_table if in_tower else table, name, config.get("num_hidden_layers", 0))
        if found is None:
            raise MergerError(f"tensor {name} has no HF name in torchtitan's {family.name} table (is this a "
                              f"torchtitan {family.name} checkpoint? --model names the family), {catalog.root}")
        row, targets = found
        if vision and not in_tower:
            targets = tuple(map(vision.text_name, targets))
        if row.kind == "joined":
            continue  # written by the row that joins it
        if row.kind == "skip" or (row.only_with and name.replace(row.source, row.only_with) not in catalog.tensors):
            skipped.append(f"{name} ({row.reason})")
        elif row.joined:
            steps.append(kinds.step(name, t.shape, t.dtype, row.kind, targets, config,
                                    joined=_parts(catalog, name, row)))
        elif kinds.KINDS[row.kind].per_expert:
            stacks[name] = partial("{}.{}".format, name)
            (shape,), _ = kinds.KINDS[row.kind].plan(name, t.shape, config)
            steps += [cast(stacks[name](e), targets[0].format(e=e), shape, t.dtype) for e in range(t.shape[0])]
        elif kinds.KINDS[row.kind].expertwise:  # kept stacked (gpt-oss), written an expert's slab at a time
            stacks[name] = partial("{}.{}".format, name)
            steps += kinds.stacked_steps([stacks[name](e) for e in range(t.shape[0])], t.shape, t.dtype, row.kind,
                                         targets[0], config)
            kept_stacked += 1
        else:
            steps.append(kinds.step(name, t.shape, t.dtype, row.kind, targets, config))
    steps += mtp.shared_steps(catalog, TORCHTITAN, family, config, layers)
    note = f"merger: torchtitan {family.name} names, written as HF {config.get('model_type')}"
    if vision:
        note += " with its vision tower"
    if len(stacks) > kept_stacked:
        note += f"; {len(stacks) - kept_stacked} stacked expert tensors split per expert"
    if kept_stacked:
        note += f"; {kept_stacked} stacked expert tensors written stacked, an expert at a time"
    if layers:
        note += f"; {len(layers)} MTP layers written as {mtp.where(family, layers, config.get('num_hidden_layers', 0))}"
    elif options.drop_mtp and any(n.startswith(TORCHTITAN.mtp.prefix) for n in catalog.tensors):
        note += "; MTP layers left out (--drop-mtp)"
    skipped += [f"{prefix}* ({count} tensors: {why})" for (prefix, why), count in left_out.items()]
    if skipped:
        note += f"; left out: {', '.join(skipped)}"
    return Mapping(steps, hf_dir, config, config_updates=mtp.count_update(family, layers), notes=(note,),
                   catalog=unstacked(catalog, stacks) if stacks else None)
