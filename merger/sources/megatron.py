"""`--backend megatron`: a Megatron checkpoint in either on-disk format (legacy torch or torch_dist).

verl's Megatron workers may instead write the weights as HF safetensors into `huggingface/`, leaving a
`dist_ckpt/` without model tensors (or none): that case merges from the safetensors. A LoRA run trained with
Megatron-Bridge leaves the adapter as a HF PEFT folder (`huggingface/adapter/`) and as Megatron-named shards in
`dist_ckpt/`: verl_peft.py's.
"""
from __future__ import annotations

from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import weight_files
from . import hf_safetensors, megatron_dist, megatron_legacy, verl_peft
from .megatron_layout import checkpoint_dir, verl_model
from .verl_manifest import MANIFEST, VerlModel


def detect(root: Path) -> bool:
    if megatron_legacy.detect(root) or megatron_dist.detect(root):
        return True
    verl = verl_model(root)
    return verl is not None and (verl.adapter is not None or bool(weight_files(verl.hf_dir)))


def open_catalog(root: Path) -> Catalog:
    if megatron_legacy.detect(root):
        return megatron_legacy.open_catalog(root)
    verl = verl_model(root)
    catalog = _open_verl_or_dist(root, verl)
    if verl is not None and verl.manifest is None and verl.dist_ckpt.parent == root / "model":
        # verl writes the manifest last; its own layout migration script leaves none either. Every file read
        # is still checked (DCP metadata, safetensors headers), so this warns rather than refuses.
        catalog.notes += (f"merger: warning: no {MANIFEST} in {root}: verl writes it last, so this save may be "
                          "unfinished (or was migrated from the older layout); merging what is there",)
    return catalog


def _open_verl_or_dist(root: Path, verl: VerlModel | None) -> Catalog:
    if verl is not None:
        if verl.adapter is not None:
            return verl_peft.open_catalog(root, verl)
        if verl_peft.has_adapter_shards(verl):
            return verl_peft.open_adapter_shards(root, verl)
    ckpt, hf_dir = checkpoint_dir(root)
    if hf_dir is not None and weight_files(hf_dir) and not (ckpt.is_dir() and megatron_dist.holds_model(ckpt)):
        return hf_safetensors.open_catalog(hf_dir, format_root=root)
    if verl is not None and not (ckpt / "metadata.json").is_file():
        raise MergerError(f"verl checkpoint holds no model weights: no Megatron shards in {ckpt} and no "
                          f"safetensors in {verl.hf_dir}, {root}")
    return megatron_dist.open_catalog(root)
