"""One `torch.save`d state dict (a legacy PEFT `adapter_model.bin`): loaded memory-mapped, weights_only."""
from __future__ import annotations

from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError
from .mapped_states import MappedStates
from .safe_load import check_zip_end, torch_load


def load_state(path: str) -> dict:
    try:
        state = torch_load(path, "adapter file")
    except MergerError:
        # files from torch < 1.6 are not zip archives and cannot be mapped: one plain weights-only try more
        state = torch_load(path, "adapter file", mmap=False)
    if not isinstance(state, dict):
        raise MergerError(f"file holds a {type(state).__name__}, not a state dict, {path}")
    return state


def open_file_catalog(path: Path, fmt: str = "torch_file") -> Catalog:
    state = load_state(str(path))
    tensors = {name: SourceTensor(name, tuple(v.shape), v.dtype,
                                  (ShardPiece((0,) * v.dim(), tuple(v.shape), (PieceCopy(str(path), name),)),))
               for name, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise MergerError(f"no tensors in the file, {path}")
    return Catalog(format=fmt, root=path.parent, tensors=tensors, files=[str(path)], reader_factory=TorchFileReader,
                   check_file=check_zip_end)


class TorchFileReader:
    def __init__(self, catalog: Catalog):
        self.states = MappedStates(load_state)

    def check_files(self, files: list[str]) -> None:
        for f in files:
            self.states[f]  # loads and checks it

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        value = self.states[copy.file].get(copy.key)
        if not isinstance(value, torch.Tensor):
            raise MergerError(f"tensor {copy.key} is missing since planning, {copy.file}")
        return self.states.stored(copy.file, value)
