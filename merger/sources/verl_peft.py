"""LoRA runs of verl's Megatron workers with Megatron-Bridge (`lora.*` set, mbridge on).

verl then saves the adapter twice: its Megatron shards into `model/dist_ckpt/` (torch_dist, names such as
`decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight`, without lora_alpha), and, when the save
writes HF weights, Megatron-Bridge's HF PEFT export into `model/huggingface/adapter/` (adapter_config.json +
adapter_model.safetensors, HF module names). The base weights are the model the run started from; mbridge's
`model/huggingface/` may hold them too. merger reads the export when there is one: the catalog is the adapter,
and mapping/lora/megatron_peft.py folds it into the base or writes it as an adapter folder. Without one, the
catalog is the Megatron shards themselves (`<linear>.adapter.linear_in.weight` [r, in] and `.linear_out.weight`
[out, r], global and TP-independent as torch_dist stores them), which mapping/lora/megatron_shards.py turns into
HF names. Other adapter shards (DoRA's magnitudes, canonical LoRA's per-q/k/v adapters) are refused, never
dropped for a silent base-only merge.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import config_dir, weight_files
from .dcp_metadata import load_metadata
from . import megatron_dist
from .megatron_dist import MODEL_PREFIXES
from .verl_manifest import VerlModel

FORMAT = "verl_megatron_peft"
SHARDS_FORMAT = "verl_megatron_lora_shards"
_ADAPTER_PART = ".adapter."  # Megatron-Bridge's AdapterWrapper keeps the adapter's state under this prefix
LINEAR_IN, LINEAR_OUT = "linear_in.weight", "linear_out.weight"  # its LoRA's A [r, in] and B [out, r]


def adapter_parts(verl: VerlModel) -> list[str]:
    """The Megatron-Bridge adapter shards in the dist_ckpt, if it is a torch_dist checkpoint."""
    if not (verl.dist_ckpt / "metadata.json").is_file():
        return []
    meta = load_metadata(verl.dist_ckpt)
    return sorted(n for n in meta.state_dict_metadata if n.startswith(MODEL_PREFIXES) and _ADAPTER_PART in n)


def adapter_linear(name: str) -> tuple[str, str] | None:
    """`<linear>.adapter.linear_in.weight` -> (`<linear>`, "linear_in"); None for any other name."""
    linear, _, part = name.partition(_ADAPTER_PART)
    if part not in (LINEAR_IN, LINEAR_OUT) or not linear:
        return None
    return linear, part.split(".")[0]


def open_shards_catalog(root: Path, verl: VerlModel, parts: list[str]) -> Catalog:
    """The Megatron-named adapter shards of a save without the HF export, as a catalog of their own (its tensors
    one per layer, as megatron_dist.py reads them)."""
    catalog = megatron_dist.open_catalog(root)
    base = next((n for n in catalog.tensors if _ADAPTER_PART not in n), None)
    if base is not None:
        raise MergerError(f"the dist_ckpt holds the model's Megatron shards (such as {base}) with LoRA adapter shards "
                          f"(such as {parts[0]}) and there is no HF PEFT export beside them: merger folds adapter "
                          f"shards into HF base weights only, {verl.dist_ckpt}")
    odd = next((n for n in catalog.tensors if adapter_linear(n) is None), None)
    if odd is not None:
        raise MergerError(f"adapter shard {odd} is not a plain LoRA linear_in / linear_out weight (DoRA, canonical "
                          f"LoRA and adapter biases are not folded), {verl.dist_ckpt}")
    details = {"checkpoint": str(root), "adapter shards": str(verl.dist_ckpt),
               "base weights": str(verl.hf_dir) if weight_files(verl.hf_dir) else "none",
               "manifest": str(verl.manifest) if verl.manifest else "none"}
    return dataclasses.replace(catalog, format=SHARDS_FORMAT, hf_dir=config_dir(verl.hf_dir), details=details)


def open_catalog(root: Path, verl: VerlModel) -> Catalog:
    from ..mapping.lora.adapter import open_adapter_catalog  # the adapter folder reader LoRA's mappers share

    adapter = open_adapter_catalog(verl.adapter)
    base = weight_files(verl.hf_dir)
    details = {"checkpoint": str(root), "adapter": str(verl.adapter),
               "base weights": str(verl.hf_dir) if base else "none (the model the run started from)",
               "manifest": str(verl.manifest) if verl.manifest else "none"}
    return dataclasses.replace(adapter, format=FORMAT, hf_dir=config_dir(verl.hf_dir), details=details)

