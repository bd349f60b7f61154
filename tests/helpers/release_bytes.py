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


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_only_changed_groups_redone(module: str, parts: tuple[str, str], before: torch.Tensor, after: torch.Tensor,
                                      got: dict, want: dict, stored: dict, group: int) -> torch.Tensor:
    """Weight `<module>.weight` changed from `before` to `after` in one group of `group` elements: in `got`, that
    group's codes and scale (`parts`: their suffixes) are `want`'s (the producing tool's), every other group's
    `stored`'s (the release's); the changed groups, bool [out, in / group]."""
    moved = (bits(after) != bits(before)).unflatten(-1, (-1, group)).any(-1)
    assert int(moved.sum()) == 1
    for part in parts:
        got_g, want_g, stored_g = (s[module + part].unflatten(-1, (moved.shape[-1], -1)) for s in (got, want, stored))
        assert torch.equal(bits(got_g[moved]), bits(want_g[moved])), part
        assert torch.equal(bits(got_g[~moved]), bits(stored_g[~moved])), part
    return moved


def groups_differ(module: str, parts: tuple[str, str], a: dict, b: dict) -> torch.Tensor:
    """bool [out, in / group]: whether each group of `<module>.weight` has other bytes (its codes or its scale: the
    suffixes `parts`) in the state dicts `a` and `b`."""
    codes, scale = parts
    grouped = [bits(s[module + codes]).unflatten(-1, (a[module + scale].shape[-1], -1)) for s in (a, b)]
    return (grouped[0] != grouped[1]).any(-1) | (bits(a[module + scale]) != bits(b[module + scale]))
