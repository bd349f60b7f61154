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
    dtype: str = "bfloat16"
    max_shard_size: int = 5_000_000_000
    max_inflight: int = 1 << 30
    device: str = "auto"
    overwrite: bool = False
    tie_word_embedding: bool = False
    trust_remote_code: bool = False
    is_value_model: bool = False
    dist_timeout: float = 600.0
    debug: bool = False

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype]
