"""FSDP checkpoints of PEFT-wrapped models: fold the adapter into the base (default) or keep it apart, and
write it as a PEFT adapter folder `lora_adapter/` that PEFT loads onto the merged base.

The state dict of a PEFT-wrapped model names base weights `base_model.model.<m>.base_layer.weight` and the
adapter `<m>.lora_A.<adapter>.weight`; modules_to_save appear as `<m>.original_module.*` beside
`<m>.modules_to_save.<adapter>.*`. r and lora_alpha are not in the weights: they come from
`lora_train_meta.json` beside the rank files (verl writes it), --lora-r / --lora-alpha, or --adapter_config
(checkpoint_config.py). A state without base weights (verl's save_lora_only) is lora/adapter_state.py's.
"""
from __future__ import annotations

import json
import re

from ...catalog import Catalog
from ...errors import MergerError
from ...options import MergeOptions
from ...sources.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from ..hf import model_config
from ..policy import ties
from ..steps import Mapping
from .adapter import PEFT_PREFIX, adapter_file_steps, build_adapter, describe, split_key
from .checkpoint_config import checkpoint_config
from .fold_steps import fold_steps

ADAPTER_DIR = "lora_adapter"
ADAPTER_FILE = f"{ADAPTER_DIR}/{WEIGHTS_FILE}"
_PART = re.compile(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)"
                   r"(\.weight|\.bias)?$")
_SAVED = re.compile(r"^(.*)\.modules_to_save\.([^.]+)\.(.*)$")


def is_peft_state(catalog: Catalog) -> bool:
    """A PEFT-wrapped model's state: LoRA parts named with their adapter (`lora_A.default.weight`). Adapter-only
    states (`lora_A.weight` as in an adapter file, or such a state without base weights) are adapter_state.py's."""
    names = list(catalog.tensors)
    return all(n.startswith(PEFT_PREFIX) for n in names) and any(_PART.match(n) and not split_key(n) for n in names)


def split_state_names(catalog: Catalog) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """(HF name -> base source tensor, adapter-file-form key -> source tensor, adapter names seen)."""
    base, keys, names = {}, {}, set()
    for name in catalog.tensors:
        rel = name[len(PEFT_PREFIX):]
        if m := _PART.match(rel):
            module, part, adapter, tail = m.groups()
            names.add(adapter)
            keys[f"{module}.{part}{tail or ''}".replace("lora_magnitude_vector.weight", "lora_magnitude_vector")] = name
        elif m := _SAVED.match(rel):
            names.add(m.group(2))
            keys[f"{m.group(1)}.{m.group(3)}"] = name
        else:
            base[rel.replace(".base_layer.", ".").replace(".original_module.", ".")] = name
    return base, keys, names


def state_keys(catalog: Catalog) -> tuple[dict[str, str], dict[str, str]]:
    """(HF name -> base source tensor, adapter-file-form key -> source tensor) of the one adapter the state holds."""
    base, keys, names = split_state_names(catalog)
    if len(names) > 1:
        raise MergerError(f"the checkpoint holds several LoRA adapters {sorted(names)}; merger folds one, "
                          f"{catalog.root}")
    return base, keys


def lora_note(config: dict, modules: int, mode: str, into: str) -> str:
    """The log line for a merge that found an adapter: what it is and what becomes of it."""
    done = (f"folded into {into} (--lora fuse)" if mode == "fuse"
            else f"{into} written unfused (--lora separate)")
    return f"merger: LoRA adapter found ({describe(config, modules)}): {done}; the adapter goes to {ADAPTER_DIR}/ " \
           f"in the target"


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return is_peft_state(catalog)


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    base, keys = state_keys(catalog)
    peft_config, found = checkpoint_config(catalog, keys, options, config, base)
    adapter = build_adapter(f"adapter in {catalog.root}" + (f" with config {found}" if found else ""), peft_config,
                            keys, {n: t.shape for n, t in catalog.tensors.items()})
    fused = fold_steps(base, [adapter] if options.lora == "fuse" else [], catalog.tensors, ties(config, options))
    return Mapping(fused.steps + adapter_file_steps(catalog.tensors, keys, ADAPTER_FILE), hf_dir, config,
                   config_updates={"tie_word_embeddings": False} if fused.untied else {},
                   extra_files={f"{ADAPTER_DIR}/{CONFIG_FILE}": json.dumps(peft_config, indent=2) + "\n"},
                   notes=(lora_note(peft_config, len(adapter.modules), options.lora, "the base weights"),))
