"""`--backend megatron`: a Megatron checkpoint in either on-disk format (legacy torch or torch_dist).

verl's Megatron workers may instead write the weights as HF safetensors into `huggingface/`, leaving a
`dist_ckpt/` without model tensors: that case merges from the safetensors.
"""
from __future__ import annotations

from pathlib import Path

from ..catalog import Catalog
from ..hf_folder import weight_files
from . import hf_safetensors, megatron_dist, megatron_legacy
from .megatron_layout import checkpoint_dir


def detect(root: Path) -> bool:
    return megatron_legacy.detect(root) or megatron_dist.detect(root)


def open_catalog(root: Path) -> Catalog:
    if megatron_legacy.detect(root):
        return megatron_legacy.open_catalog(root)
    ckpt, hf_dir = checkpoint_dir(root)
    if hf_dir is not None and weight_files(hf_dir) and not megatron_dist.holds_model(ckpt):
        return hf_safetensors.open_catalog(hf_dir, format_root=root)
    return megatron_dist.open_catalog(root)
