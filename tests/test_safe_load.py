"""What a file that torch.load cannot read is called: torch.save's zip format, its legacy format, or neither.

Files are written by torch.save itself (both formats); the oracle for a loaded file is torch.load.
"""
from __future__ import annotations

import os

import pytest
import torch

from merger.errors import CorruptSourceError, MergerError
from merger.sources.safe_load import torch_load
from merger.sources.torch_file import load_state

pytestmark = pytest.mark.interpreter


@pytest.fixture
def legacy(tmp_path) -> str:
    """A state dict as torch < 1.6 saved it (a plain pickle stream, no zip), e.g. an old adapter_model.bin."""
    path = str(tmp_path / "adapter_model.bin")
    torch.save({"w": torch.randn(3, 4)}, path, _use_new_zipfile_serialization=False)
    return path


def test_legacy_file_cannot_be_mapped_but_loads_without_mmap(legacy):
    with pytest.raises(MergerError, match=r"cannot load adapter file: saved in torch's legacy .* memory-mapped"):
        torch_load(legacy, "adapter file")
    assert torch.equal(load_state(legacy)["w"], torch.load(legacy, weights_only=True)["w"])


@pytest.mark.parametrize("content", [os.urandom(4096), b"\x80\x02" + os.urandom(64), b"PK"], ids=["random",
                                                                                             "a pickle", "short"])
def test_neither_format_says_so(content, tmp_path):
    path = tmp_path / "rank.pt"
    path.write_bytes(content)
    with pytest.raises(CorruptSourceError, match=r"^cannot load rank file: not a torch\.save file .*rank\.pt$"):
        torch_load(str(path), "rank file")
