"""LoRA runs of verl's Megatron workers with Megatron-Bridge (`lora.*` set, mbridge on).

verl then saves the adapter twice: its Megatron shards into `model/dist_ckpt/` (torch_dist, names such as
`decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight`, without lora_alpha), and, when the save
writes HF weights, Megatron-Bridge's HF PEFT export into `model/huggingface/adapter/` (adapter_config.json +
adapter_model.safetensors, HF module names). The base weights are the model the run started from; mbridge's
`model/huggingface/` may hold them too. merger reads the export when there is one: the catalog is the adapter,
and mapping/lora/megatron_peft.py folds it into the base or writes it as an adapter folder. Without one, the
catalog is the Megatron shards themselves (`<linear>.adapter.linear_in.weight` [r, in] and `.linear_out.weight`
[out, r], global and TP-independent as torch_dist stores them), which mapping/lora/megatron_shards.py turns into
HF names; a dist_ckpt that also holds the model's own shards (`use_dist_checkpointing`) is the Megatron catalog
as it is, with its adapter (mapping/lora/megatron_lora_model.py). Adapter shards are never dropped for a silent
base-only merge.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..catalog import Catalog
from ..hf_folder import config_dir, weight_files
from . import megatron_dist
from .dcp_metadata import load_compact
from .megatron_dist import MODEL_PREFIXES
from .peft_adapter import open_adapter_catalog
from .verl_manifest import VerlModel

FORMAT = "verl_megatron_peft"
SHARDS_FORMAT = "verl_megatron_lora_shards"
_ADAPTER_PART = ".adapter."  # Megatron-Bridge's AdapterWrapper keeps the adapter's state under `<linear>.adapter.`
LINEAR_IN, LINEAR_OUT = "linear_in.weight", "linear_out.weight"  # its LoRA's A [r, in] and B [out, r]


def has_adapter_shards(verl: VerlModel) -> bool:
    """Whether the dist_ckpt is a torch_dist checkpoint holding Megatron-Bridge adapter shards."""
    if not (verl.dist_ckpt / "metadata.json").is_file():
        return False
    meta, _ = load_compact(verl.dist_ckpt)  # the names alone: no object per chunk
    return any(n.startswith(MODEL_PREFIXES) and is_adapter_shard(n) for n in meta.state_dict_metadata)


def is_adapter_shard(name: str) -> bool:
    return _ADAPTER_PART in name


def adapter_linear(name: str) -> tuple[str, str] | None:
    """`<linear>.adapter.linear_in.weight` -> (`<linear>`, "linear_in"); None for any other name."""
    linear, _, part = name.partition(_ADAPTER_PART)
    if part not in (LINEAR_IN, LINEAR_OUT) or not linear:
        return None
    return linear, part.split(".")[0]


def open_adapter_shards(root: Path, verl: VerlModel) -> Catalog:
    """The dist_ckpt holding Megatron-named adapter shards: marked SHARDS_FORMAT when they are all it holds (the
    base is HF weights, mapping/lora/megatron_shards.py), else the model's Megatron shards with their adapter as
    they are (mapping/lora/megatron_lora_model.py)."""
    catalog = megatron_dist.open_catalog(root)
    if any(not is_adapter_shard(n) for n in catalog.tensors):
        return catalog
    details = {"checkpoint": str(root), "adapter shards": str(verl.dist_ckpt),
               "base weights": str(verl.hf_dir) if weight_files(verl.hf_dir) else "none",
               "manifest": str(verl.manifest) if verl.manifest else "none"}
    return dataclasses.replace(catalog, format=SHARDS_FORMAT, hf_dir=config_dir(verl.hf_dir), details=details)


def open_catalog(root: Path, verl: VerlModel) -> Catalog:
    adapter = open_adapter_catalog(verl.adapter)
    base = weight_files(verl.hf_dir)
    details = {"checkpoint": str(root), "adapter": str(verl.adapter),
               "base weights": str(verl.hf_dir) if base else "none (the model the run started from)",
               "manifest": str(verl.manifest) if verl.manifest else "none"}
    return dataclasses.replace(adapter, format=FORMAT, hf_dir=config_dir(verl.hf_dir), details=details)

