"""LoRA runs of verl's Megatron workers with Megatron-Bridge (`lora.*` set, mbridge on).

verl then saves the adapter twice: its Megatron shards into `model/dist_ckpt/` (torch_dist, names such as
`decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight`, without lora_alpha), and, when the save
writes HF weights, Megatron-Bridge's HF PEFT export into `model/huggingface/adapter/` (adapter_config.json +
adapter_model.safetensors, HF module names). The base weights are the model the run started from; mbridge's
`model/huggingface/` may hold them too. merger reads the export: the catalog is the adapter, and
mapping/lora/megatron_peft.py folds it into the base or writes it as an adapter folder. Megatron-named adapter
shards with no export are refused, never dropped for a silent base-only merge.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import config_dir, weight_files
from .dcp_metadata import load_metadata
from .megatron_dist import MODEL_PREFIXES
from .verl_manifest import VerlModel

FORMAT = "verl_megatron_peft"
_ADAPTER_PART = ".adapter."  # Megatron-Bridge's AdapterWrapper keeps the adapter's state under this prefix


def adapter_parts(verl: VerlModel) -> list[str]:
    """The Megatron-Bridge adapter shards in the dist_ckpt, if it is a torch_dist checkpoint."""
    if not (verl.dist_ckpt / "metadata.json").is_file():
        return []
    meta = load_metadata(verl.dist_ckpt)
    return sorted(n for n in meta.state_dict_metadata if n.startswith(MODEL_PREFIXES) and _ADAPTER_PART in n)


def unfoldable(verl: VerlModel, parts: list[str]) -> MergerError:
    return MergerError(
        f"the checkpoint's LoRA adapter is only in Megatron-Bridge shards ({len(parts)} tensors such as {parts[0]}), "
        f"which record no lora_alpha, and there is no HF PEFT export beside them (verl writes one into "
        f"model/huggingface/adapter/ when it saves HF weights: save_contents with hf_model, or model without "
        f"use_dist_checkpointing): merger does not fold them; export the "
        f"adapter with Megatron-Bridge, then `merger lora --base BASE_MODEL --adapter ADAPTER_DIR`, {verl.dist_ckpt}")


def open_catalog(root: Path, verl: VerlModel) -> Catalog:
    from ..mapping.lora.adapter import open_adapter_catalog  # the adapter folder reader LoRA's mappers share

    adapter = open_adapter_catalog(verl.adapter)
    base = weight_files(verl.hf_dir)
    details = {"checkpoint": str(root), "adapter": str(verl.adapter),
               "base weights": str(verl.hf_dir) if base else "none (the model the run started from)",
               "manifest": str(verl.manifest) if verl.manifest else "none"}
    return dataclasses.replace(adapter, format=FORMAT, hf_dir=config_dir(verl.hf_dir), details=details)

