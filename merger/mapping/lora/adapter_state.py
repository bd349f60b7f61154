"""Adapter-only checkpoints of PEFT models: the adapter's tensors and no base weights. Two trainers write them:
- accelerate, for HF Trainer with FSDP SHARDED_STATE_DICT: `save_fsdp_model(..., adapter_only=True)` saves
  `get_peft_model_state_dict(model)` with `dcp.save` under the "model" key, named as in a PEFT adapter file
  (`base_model.model.<m>.lora_A.weight`, `lora_embedding_A`, `lora_magnitude_vector`, modules_to_save as
  `<m>.weight`, saved embeddings as `<m>.base_layer.weight`), each tensor sharded, and no adapter config;
- verl with `checkpoint.save_lora_only=True` (FSDP/FSDP2 engine): the rank files hold the PEFT-wrapped model's
  state filtered to the names holding `lora_` or `.adapter_` (`<m>.lora_A.default.weight`,
  `lora_embedding_A.default`; modules_to_save copies are dropped), plus `lora_train_meta.json`.
The merge writes:
- without a base model: the target is a PEFT adapter folder (adapter_config.json + adapter_model.safetensors,
  the tensors in their saved dtype under PEFT's file names), which `PeftModel.from_pretrained(base, target)` loads;
- with `--base_model DIR` (a HF safetensors folder): the base with the adapter folded in, as PEFT's
  merge_and_unload does (the `merger lora` machinery), plus the adapter as `lora_adapter/`.
The adapter config comes from checkpoint_config.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from ...catalog import Catalog
from ...errors import MergerError
from ...hf_folder import read_config
from ...io import location
from ...options import MergeOptions
from ...sources.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from ..steps import Mapping, Step
from .adapter import (PEFT_PREFIX, LoraAdapter, adapter_file_steps, adapter_from_catalog, describe, file_keys,
                      split_key)
from .adapter_folders import base_model_name, fold_into_base, open_base
from .checkpoint_config import checkpoint_config
from .peft_state import ADAPTER_DIR, ADAPTER_FILE, is_peft_state, lora_note, split_state_names, state_keys

ADAPTER_PART = "adapter:"  # name prefix of the adapter's tensors in the catalog shared with a base model


def is_adapter_state(catalog: Catalog) -> bool:
    """Only adapter tensors: accelerate's DCP save (names as in a PEFT adapter file), or verl's save_lora_only (a
    PEFT-wrapped model's state without its base weights)."""
    names = list(catalog.tensors)
    if not names or not all(n.startswith(PEFT_PREFIX) for n in names):
        return False
    if is_peft_state(catalog):
        return not split_state_names(catalog)[0]
    return catalog.format == "dcp" and any(split_key(n) for n in names)


def _adapter_keys(catalog: Catalog) -> dict[str, str]:
    """Adapter-file-form key (without `base_model.model.`) -> tensor name, for either naming."""
    return state_keys(catalog)[1] if is_peft_state(catalog) else file_keys(catalog, catalog.root)


def _model_config(options: MergeOptions, catalog: Catalog) -> dict:
    """The model's config.json when one is known (it tells a Conv1D model, whose adapters are fan_in_fan_out)."""
    if options.base_model is not None:
        return read_config(location(options.base_model))
    hf_dir = options.hf_model_config_path or catalog.hf_dir
    return read_config(Path(hf_dir)) if hf_dir is not None and (Path(hf_dir) / "config.json").is_file() else {}


def peft_config(catalog: Catalog, keys: dict[str, str], options: MergeOptions,
                base: dict[str, str] | None) -> tuple[dict, str]:
    """The adapter's config and a name for it in messages."""
    model_config = _model_config(options, catalog)
    config, found = checkpoint_config(catalog, keys, options, model_config, base)
    if found is not None:
        return config, f"adapter in {catalog.root} with config {found}"
    if options.base_model is not None:
        config["base_model_name_or_path"] = base_model_name(options.base_model)
    elif model_config.get("_name_or_path"):
        config["base_model_name_or_path"] = model_config["_name_or_path"]
    return config, f"adapter in {catalog.root}"


def _drop_unsaved_modules(config: dict, adapter: LoraAdapter) -> tuple[dict, tuple[str, ...]]:
    """verl's save_lora_only keeps no modules_to_save copies. A given config that names some would make an adapter
    folder PEFT fails to load (it looks for their weights): they leave the written config, those modules keep the
    base model's values, and the log says so."""
    if not config.get("modules_to_save") or adapter.replacements:
        return config, ()
    return dict(config, modules_to_save=None), (
        f"merger: the adapter config names modules_to_save {config['modules_to_save']}, but the checkpoint holds no "
        f"weights for them (verl's save_lora_only keeps only lora_ tensors): they keep the base model's values and "
        f"are left out of the written adapter_config.json",)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return is_adapter_state(catalog)


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    """An adapter folder, or with --base_model the folded model (plus the adapter as lora_adapter/)."""
    keys = _adapter_keys(catalog)
    if options.base_model is None:
        config, name = peft_config(catalog, keys, options, None)
        adapter = adapter_from_catalog(name, config, "", catalog, keys)  # checks the config against the tensors
        config, dropped = _drop_unsaved_modules(config, adapter)
        note = (f"merger: adapter-only LoRA checkpoint ({describe(config, len(adapter.modules))}): the target is a "
                f"PEFT adapter folder (--base_model DIR folds it into a base model)")
        return adapter_folder(catalog, keys, config, options, (note, *dropped))
    base = open_base(location(options.base_model))
    config, name = peft_config(catalog, keys, options, {n: n for n in base.tensors})
    adapter = adapter_from_catalog(name, config, ADAPTER_PART, catalog, keys)
    config, dropped = _drop_unsaved_modules(config, adapter)
    return folded(base, catalog, keys, adapter, config, options, dropped)


def adapter_folder(catalog: Catalog, keys: dict[str, str], config: dict, options: MergeOptions,
                   notes: tuple[str, ...]) -> Mapping:
    """The adapter alone as a PEFT adapter folder; `keys` maps adapter-file-form keys to catalog tensors."""
    return adapter_folder_of(adapter_file_steps(catalog.tensors, keys, WEIGHTS_FILE), config, options,
                             catalog.root, notes)


def adapter_folder_of(steps: list[Step], config: dict, options: MergeOptions, root: object,
                      notes: tuple[str, ...]) -> Mapping:
    """The target as a PEFT adapter folder: `steps` write adapter_model.safetensors, `config` its config."""
    if options.verify:  # verification reads the model's weight files back, and an adapter folder has none
        raise MergerError(f"--verify checks a merged model; the output here is an adapter folder (pass "
                          f"--base_model to merge one, or drop --verify), {root}")
    # No HF folder: the target is an adapter folder, not a model (no config.json to complete).
    return Mapping(steps, None, {}, extra_files={CONFIG_FILE: json.dumps(config, indent=2) + "\n"}, notes=notes)


def folded(base: Catalog, catalog: Catalog, keys: dict[str, str], adapter: LoraAdapter, config: dict,
           options: MergeOptions, notes: tuple[str, ...] = ()) -> Mapping:
    """`base` (a HF folder) with the adapter folded in (`--lora fuse`) or not, and the adapter as lora_adapter/
    with `config`; `adapter` was built from `catalog` under ADAPTER_PART."""
    return fold_into_base(base, {ADAPTER_PART: catalog}, [adapter] if options.lora == "fuse" else [], options,
                          f"hf_safetensors+{catalog.format}_adapter",
                          tuple(adapter_file_steps(catalog.tensors, keys, ADAPTER_FILE, ADAPTER_PART)),
                          {f"{ADAPTER_DIR}/{CONFIG_FILE}": json.dumps(config, indent=2) + "\n"},
                          (lora_note(config, len(adapter.modules), options.lora, f"the base model {base.root}"),
                           *notes))
