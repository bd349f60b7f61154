"""Everything a merge is told, as one plain dataclass shared by the CLI, the launcher and the tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "keep": None}


@dataclass
class MergeOptions:
    local_dir: Path
    target_dir: Path | None = None
    backend: str = "auto"
    hf_model_config_path: Path | None = None
    prefix: str | None = None  # DCP: the nesting prefix to take off names (None: detect)
    model: str = "auto"  # source naming: auto (detect from names), hf, torchtitan-llama
    dtype: str = "bfloat16"
    max_shard_size: int = 5_000_000_000
    max_inflight: int = 1 << 30
    device: str = "auto"
    overwrite: bool = False
    tie_word_embedding: bool = False
    trust_remote_code: bool = False
    dist_timeout: float = 600.0
    debug: bool = False
    keep_partial: bool = False  # keep the staging folder when a merge fails
    resume: bool = False  # reuse the finished files of an interrupted merge (implies keep_partial)
    is_value_model: bool = False  # a critic: token-classification head with one label (`score.weight`)
    verify: bool = False  # re-read the written output and compare it with the source before the rename
    hf_upload_path: str | None = None  # "user/name": publish the finished folder to the Hugging Face Hub
    private: bool = False
    summary_json: Path | None = None
    lora: str = "fuse"  # PEFT-wrapped checkpoints: fold the adapter in, or write it apart ("separate")
    lora_r: int | None = None
    lora_alpha: float | None = None
    base_model: Path | None = None  # adapter-only checkpoints: the HF folder to fold the adapter into
    adapter_config: Path | None = None  # adapter-only checkpoints: their adapter_config.json (file or folder)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype]
