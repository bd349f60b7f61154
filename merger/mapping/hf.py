"""Checkpoints whose tensor names are already HF module names (verl FSDP, DCP, DeepSpeed, a HF folder): one cast
per tensor, under the names the installed transformers' save_pretrained writes (saved_names.py)."""
from __future__ import annotations

from pathlib import Path

from ..catalog import Catalog
from ..hf_folder import model_config_dir, read_config
from ..options import MergeOptions
from .saved_names import rename_outputs, saved_names
from .steps import Mapping, cast


def model_config(catalog: Catalog, options: MergeOptions) -> tuple[Path, dict]:
    """The model's HF config folder (--hf_model_config_path, else the one found beside the checkpoint) and its
    config.json."""
    hf_dir = model_config_dir(options.hf_model_config_path, catalog.hf_dir, catalog.root)
    return hf_dir, read_config(hf_dir)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return catalog.naming == "hf"


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    steps = [cast(name, name, t.shape, t.dtype) for name, t in catalog.tensors.items()]
    return Mapping(rename_outputs(steps, saved_names(hf_dir, config, list(catalog.tensors), options.trust_remote_code)),
                   hf_dir, config)
