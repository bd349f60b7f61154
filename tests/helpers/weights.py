"""Reading merged folders with the safetensors library (not merger's reader) and comparing them with the
model's own weights."""
from __future__ import annotations

from pathlib import Path

import torch


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF folder, read by the safetensors library (not our reader)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_bitwise(written: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """The same names, and each tensor `expected`'s in `dtype` bit for bit (a view as integers: -0.0 is not 0.0)."""
    assert set(written) == set(expected)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    for name, tensor in written.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor.view(bits), expected[name].to(dtype).view(bits)), name


def assert_same_weights(merged: Path, reference: Path, dtype: torch.dtype | None) -> None:
    """The merge equals the model's own weights (save_pretrained's output) cast to `dtype`, bit for bit."""
    ours, ref = load_safetensors_folder(merged), load_safetensors_folder(reference)
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        want = want.to(dtype) if dtype is not None and want.is_floating_point() else want
        assert ours[name].dtype == want.dtype, name
        assert torch.equal(ours[name], want), name
