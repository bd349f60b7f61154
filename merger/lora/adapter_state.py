"""Adapter-only checkpoints of PEFT models, as accelerate writes them for HF Trainer with FSDP SHARDED_STATE_DICT.

`save_fsdp_model(..., adapter_only=True)` saves `get_peft_model_state_dict(model)` with `dcp.save` under the
"model" key: the DCP holds only the adapter, named as in a PEFT adapter file (`base_model.model.<m>.lora_A.weight`,
`lora_embedding_A`, `lora_magnitude_vector`, modules_to_save as `<m>.weight`, saved embeddings as
`<m>.base_layer.weight`), each tensor sharded, and no adapter config. The merge writes:
- without a base model: the target is a PEFT adapter folder (adapter_config.json + adapter_model.safetensors,
  the tensors in their saved dtype), which `PeftModel.from_pretrained(base, target)` loads;
- with `--base_model DIR` (a HF safetensors folder): the base with the adapter folded in, as PEFT's
  merge_and_unload does (the `merger lora` machinery), plus the adapter as `lora_adapter/`.
r and lora_alpha come from an adapter_config.json in checkpoint-N/ or its parent (the Trainer's output folder, where
a final `save_model` writes one), from `--adapter_config`, or, with none of these, from `--lora_r` / `--lora_alpha`
with the rest of the config read off the tensors.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..mapping import read_config
from ..merge import Prepared
from ..options import MergeOptions
from ..plan import OutputSpec, Step, plan_layout
from ..sources.dcp import ACCELERATE_DIR
from .adapter import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, adapter_from_catalog, config_from_tensors, describe,
                      file_keys, read_config_file, split_key)
from .into_base import fold_into_base, open_base
from .peft_state import ADAPTER_DIR, is_peft_state, lora_note, resolve_flag

log = logging.getLogger("merger")
ADAPTER_PART = "adapter:"  # name prefix of the adapter's tensors in the catalog shared with a base model


def is_adapter_state(catalog: Catalog) -> bool:
    """Only adapter tensors, named as in a PEFT adapter file (a wrapped model's state names its adapter)."""
    names = list(catalog.tensors)
    return (catalog.format == "dcp" and all(n.startswith(PEFT_PREFIX) for n in names)
            and any(split_key(n) for n in names) and not is_peft_state(catalog))


def refuse_adapter_flags(options: MergeOptions, catalog: Catalog) -> None:
    """--base_model / --adapter_config on any other checkpoint would be ignored: say so instead."""
    for flag, value in (("--base_model", options.base_model), ("--adapter_config", options.adapter_config)):
        if value is not None:
            raise MergerError(f"{flag} applies to adapter-only checkpoints (accelerate's adapter_only DCP save), "
                              f"and this {catalog.format} checkpoint holds a whole model, {catalog.root}")


def _config_paths(catalog: Catalog, flag: Path | None) -> list[Path]:
    """Where an adapter_config.json may be: the flag's file (or folder), else checkpoint-N/ and its parent."""
    if flag is not None:
        return [flag / CONFIG_FILE if flag.is_dir() else flag]
    checkpoint = catalog.root.parent if catalog.root.name == ACCELERATE_DIR else catalog.root
    return [checkpoint / CONFIG_FILE, checkpoint.parent / CONFIG_FILE]


def _model_config(options: MergeOptions, catalog: Catalog) -> dict:
    """The model's config.json when one is known (it tells a Conv1D model, whose adapters are fan_in_fan_out)."""
    if options.base_model is not None:
        return read_config(Path(options.base_model))
    hf_dir = options.hf_model_config_path or catalog.hf_dir
    return read_config(Path(hf_dir)) if hf_dir is not None and (Path(hf_dir) / "config.json").is_file() else {}


def peft_config(catalog: Catalog, keys: dict[str, str], options: MergeOptions,
                base: dict[str, str] | None) -> tuple[dict, str]:
    """The adapter's config and where it came from: a saved adapter_config.json (checked against --lora_r /
    --lora_alpha), else one built from the tensors and the flags; lora_alpha is never guessed."""
    paths = _config_paths(catalog, options.adapter_config)
    found = next((p for p in paths if p.is_file()), paths[0] if options.adapter_config is not None else None)
    if found is not None:
        config = read_config_file(found)
        resolve_flag(config["r"], options.lora_r, "r", "--lora-r", found)
        resolve_flag(config["lora_alpha"], options.lora_alpha, "lora_alpha", "--lora-alpha", found)
        log.info("merger: adapter config from %s", found)
        return config, f"adapter in {catalog.root} with config {found}"
    if not options.lora_alpha:
        raise MergerError(f"the checkpoint holds only a LoRA adapter and its lora_alpha is unknown: no {CONFIG_FILE} "
                          f"in {paths[0].parent} or {paths[1].parent}; pass --lora-alpha (and --lora-r) as used in "
                          f"training, or --adapter-config PATH, {catalog.root}")
    model_config = _model_config(options, catalog)
    shapes = {n: t.shape for n, t in catalog.tensors.items()}
    config = config_from_tensors(keys, shapes, model_config, base, options.lora_r, options.lora_alpha, {})
    if options.base_model is not None:
        config["base_model_name_or_path"] = str(Path(options.base_model).absolute())
    elif model_config.get("_name_or_path"):
        config["base_model_name_or_path"] = model_config["_name_or_path"]
    return config, f"adapter in {catalog.root}"


def _adapter_steps(catalog: Catalog, prefix: str, folder: str) -> list[Step]:
    """The adapter's tensors copied under their own names into `folder`/adapter_model.safetensors, in their saved
    dtype (they are small, and PEFT upcasts them on load anyway)."""
    file = f"{folder}/{WEIGHTS_FILE}" if folder else WEIGHTS_FILE
    return [Step((prefix + name,), (OutputSpec(name, t.shape, t.dtype, file),)) for name, t in catalog.tensors.items()]


def prepare_adapter_state(catalog: Catalog, options: MergeOptions, world: int) -> Prepared:
    """The plan for an adapter-only checkpoint: an adapter folder, or with --base_model the folded model."""
    keys = file_keys(catalog, catalog.root)
    if options.base_model is None:
        if options.verify:  # verification reads the model's weight files back, and an adapter folder has none
            raise MergerError(f"--verify checks a merged model; the output here is an adapter folder (pass "
                              f"--base_model to merge one, or drop --verify), {catalog.root}")
        config, name = peft_config(catalog, keys, options, None)
        adapter = adapter_from_catalog(name, config, "", catalog)  # checks the config against the tensors
        plan = plan_layout(catalog, _adapter_steps(catalog, "", ""), world, options.max_shard_size,
                           options.max_inflight)
        # No HF folder: the target is an adapter folder, not a model (no config.json to complete).
        note = (f"merger: adapter-only LoRA checkpoint ({describe(config, len(adapter.modules))}): the target is a "
                f"PEFT adapter folder (--base_model DIR folds it into a base model)")
        return Prepared(catalog, None, {}, plan, {}, {CONFIG_FILE: json.dumps(config, indent=2) + "\n"}, (note,))
    base_dir = Path(options.base_model)
    base = open_base(base_dir)
    config, name = peft_config(catalog, keys, options, {n: n for n in base.tensors})
    adapter = adapter_from_catalog(name, config, ADAPTER_PART, catalog)
    return fold_into_base(base_dir, base, {ADAPTER_PART: catalog}, [adapter] if options.lora == "fuse" else [],
                          options, world, "hf_safetensors+dcp_adapter",
                          tuple(_adapter_steps(catalog, ADAPTER_PART, ADAPTER_DIR)),
                          {f"{ADAPTER_DIR}/{CONFIG_FILE}": json.dumps(config, indent=2) + "\n"},
                          (lora_note(config, len(adapter.modules), options.lora, f"the base model {base_dir}"),))
