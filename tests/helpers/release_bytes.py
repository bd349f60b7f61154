"""Comparing a quantized output with its release byte for byte (`--quantize_like`, #49 item 3)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers.in_process import merge_in_process
from tests.helpers.weights import load_safetensors_folder

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width: float8 codes, -0.0 and NaNs compare as what is stored."""
    return t.view(_INTS[t.element_size()])


def written_back_like(release: Path, plain: Path, target: Path, dtype: str) -> dict[str, torch.Tensor]:
    """Merge `plain` (the model read from `release`) with `--quantize_like release` at `dtype` and check every
    tensor is the release's, name, dtype and bytes; the release's tensors."""
    stored = load_safetensors_folder(release)
    back = load_safetensors_folder(merge_in_process(plain, target, "--quantize_like", release, "--dtype", dtype))
    assert sorted(back) == sorted(stored)
    for name, t in stored.items():
        assert back[name].dtype == t.dtype and torch.equal(bits(back[name]), bits(t)), name
    return stored


def trained(plain: Path, whole: list[str], partly: str, at: tuple[int, ...], folder: Path
            ) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model of HF folder `plain` after "training": each weight of `whole` plus a seeded random delta (every
    block changed), and `partly` changed in one element only (`at`, plus 0.01), saved as HF folder `folder`; the
    folder and its weights."""
    weights = load_safetensors_folder(plain)
    torch.manual_seed(3)
    for name in whole:
        weights[name] = weights[name] + (torch.randn(weights[name].shape) / 500).to(weights[name].dtype)
    weights[partly] = weights[partly].clone()
    weights[partly][at] += 0.01
    shutil.copytree(plain, folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, weights
