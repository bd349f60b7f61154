"""A PEFT adapter folder (adapter_config.json beside adapter_model.safetensors, or a legacy adapter_model.bin) as a
catalog of its tensors. The LoRA mappers (mapping/lora/) fold it; verl's Megatron PEFT export is one too."""
from __future__ import annotations

from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from .hf_safetensors import catalog_of_files
from .torch_file import open_file_catalog

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"


def open_adapter_catalog(folder: Path) -> Catalog:
    if not folder.is_dir():
        raise MergerError(f"adapter folder does not exist, {folder}")
    if (folder / WEIGHTS_FILE).is_file():
        return catalog_of_files([folder / WEIGHTS_FILE], folder, "peft_adapter")
    if (folder / LEGACY_WEIGHTS_FILE).is_file():
        return open_file_catalog(folder / LEGACY_WEIGHTS_FILE, "peft_adapter")
    raise MergerError(f"no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} in the adapter folder, {folder}")
