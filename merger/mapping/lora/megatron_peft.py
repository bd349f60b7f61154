"""The HF PEFT adapter Megatron-Bridge exported for a verl Megatron LoRA run (sources/verl_peft.py finds it).

The base is `--base_model DIR` when given (the model the run started from), else the HF weights mbridge wrote
beside the adapter in `model/huggingface/`. With a base, the adapter is folded in as merge_and_unload folds it
(`--lora separate`: the base as it is), and written beside as `lora_adapter/`; without one, the target is the
adapter folder itself, which `PeftModel.from_pretrained(base, target)` loads.
"""
from __future__ import annotations

from pathlib import Path

from ...catalog import Catalog
from ...options import MergeOptions
from ...sources.verl_peft import FORMAT
from ..steps import Mapping
from .adapter import adapter_from_folder, describe, file_keys
from .adapter_folders import base_folder, open_base
from .adapter_state import ADAPTER_PART, adapter_folder, folded


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return catalog.format == FORMAT


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    folder = Path(catalog.root)
    keys = file_keys(catalog, folder)
    base_dir = base_folder(catalog, options)
    if base_dir is None:
        adapter = adapter_from_folder(folder, "", catalog)  # checks the config against the tensors
        found = describe(adapter.config, len(adapter.modules))
        note = (f"merger: verl Megatron LoRA checkpoint without base weights ({found}, from {folder}): the target "
                f"is a PEFT adapter folder (--base_model DIR, the model the run started from, folds it in)")
        return adapter_folder(catalog, keys, adapter.config, options, (note,))
    adapter = adapter_from_folder(folder, ADAPTER_PART, catalog)
    return folded(open_base(base_dir), catalog, keys, adapter, adapter.config, options)
