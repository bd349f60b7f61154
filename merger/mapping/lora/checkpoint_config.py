"""The adapter config of a training checkpoint that holds a LoRA adapter. Neither verl nor accelerate saves an
adapter_config.json beside the weights, so r, lora_alpha and the rest come from, first found:
- `--adapter_config PATH` (a file, or a folder holding adapter_config.json), taken as saved: r, lora_alpha,
  use_rslora, rank_pattern, alpha_pattern... A `lora_train_meta.json` beside it that records another r or
  lora_alpha means the config is not this run's: an error naming both files;
- for accelerate's adapter-only DCP save, the adapter_config.json in checkpoint-N/ or its parent (the Trainer's
  output folder, where a final save_model writes one);
- verl's `lora_train_meta.json` beside the rank files (r, lora_alpha, task_type) or --lora-r / --lora-alpha, the
  rest read off the tensors. alpha_pattern and use_rslora cannot be read off tensors, and lora_alpha is never guessed.
Flags that contradict what the checkpoint records are errors too.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ...catalog import Catalog
from ...errors import MergerError
from ...options import MergeOptions
from ...sources.dcp import ACCELERATE_DIR
from ...sources.peft_adapter import CONFIG_FILE
from .adapter import config_from_tensors, read_config_file

log = logging.getLogger("merger")
META = "lora_train_meta.json"


def read_meta(root: Path) -> dict:
    path = root / META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MergerError(f"cannot read {META} ({e}), {path}") from e
    if not isinstance(meta, dict):
        raise MergerError(f"{META} is not a JSON object, {path}")
    return meta


def resolve_flag(known, flag, key: str, flag_name: str, source: Path):
    """A value the checkpoint records, else the flag; both given and different is an error, not a guess."""
    if known is not None and flag is not None and float(known) != float(flag):
        raise MergerError(f"{flag_name} {flag} disagrees with {source.name}'s {key}={known}, {source}")
    return known if known is not None else flag


def given_config_path(flag: Path) -> Path:
    """--adapter_config: the file itself, or a folder's adapter_config.json."""
    return flag / CONFIG_FILE if flag.is_dir() else flag


def _config_paths(catalog: Catalog, flag: Path | None) -> list[Path]:
    """Where an adapter_config.json may be: the flag's file (or folder); for accelerate's DCP save, checkpoint-N/
    and its parent; nowhere else (verl writes none)."""
    if flag is not None:
        return [given_config_path(flag)]
    if catalog.format != "dcp":
        return []
    checkpoint = catalog.root.parent if catalog.root.name == ACCELERATE_DIR else catalog.root
    return [checkpoint / CONFIG_FILE, checkpoint.parent / CONFIG_FILE]


def _checked_file_config(found: Path, meta: dict, catalog: Catalog, options: MergeOptions) -> dict:
    config = read_config_file(found)
    for key, flag, flag_name in (("r", options.lora_r, "--lora-r"), ("lora_alpha", options.lora_alpha, "--lora-alpha")):
        resolve_flag(config[key], flag, key, flag_name, found)
        if meta.get(key) is not None and float(meta[key]) != float(config[key]):
            raise MergerError(f"{META} records {key}={meta[key]} but {found.name} gives {key}={config[key]}: the "
                              f"adapter config is not this run's, {catalog.root / META} and {found}")
    log.info("merger: adapter config from %s", found)
    return config


def checkpoint_config(catalog: Catalog, keys: dict[str, str], options: MergeOptions, model_config: dict,
                      base: dict[str, str] | None) -> tuple[dict, Path | None]:
    """The adapter's config, and the adapter_config.json it was read from (None: built from the meta file, the
    flags and the tensors). `keys` maps adapter-file-form keys to tensor names; `base` (HF name -> tensor), when
    the base model is known, lets the built config target leaf names (see config_from_tensors)."""
    meta = read_meta(catalog.root)
    paths = _config_paths(catalog, options.adapter_config)
    found = next((p for p in paths if p.is_file()), paths[0] if options.adapter_config is not None else None)
    if found is not None:
        return _checked_file_config(found, meta, catalog, options), found
    meta_path = catalog.root / META
    r = resolve_flag(meta.get("r"), options.lora_r, "r", "--lora-r", meta_path)
    alpha = resolve_flag(meta.get("lora_alpha"), options.lora_alpha, "lora_alpha", "--lora-alpha", meta_path)
    if not alpha:
        looked = (f"no {CONFIG_FILE} in {paths[0].parent} or {paths[1].parent}" if paths
                  else f"no {META} with lora_alpha beside the weights")
        raise MergerError(f"the checkpoint holds a LoRA adapter but its lora_alpha is unknown: {looked}; pass "
                          f"--lora-alpha (and --lora-r) as used in training, or --adapter-config PATH, {catalog.root}")
    shapes = {n: t.shape for n, t in catalog.tensors.items()}
    return config_from_tensors(keys, shapes, model_config, base, r, alpha, meta), None
