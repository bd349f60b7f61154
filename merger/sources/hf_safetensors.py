"""A HF model folder of safetensors (one `model.safetensors` or shards with an index): one piece per tensor.

Headers alone give every tensor's name, shape, dtype and exact byte range, so reading is a pread of that range.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError
from ..safetensors_io import TensorEntry, read_header, read_tensor

INDEX = "model.safetensors.index.json"


def weight_files(root: Path) -> list[Path]:
    """The folder's weight files: those the index names, else model.safetensors, else every *.safetensors."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MergerError(f"cannot read the safetensors index ({e}), {index}") from e
        return [root / name for name in dict.fromkeys(sorted(weight_map.values()))]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    return sorted(root.glob("*.safetensors"))


def detect(root: Path) -> bool:
    return bool(weight_files(root))


def catalog_of_files(files: list[Path], root: Path, fmt: str) -> Catalog:
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        if not path.is_file():
            raise MergerError(f"safetensors file is missing, {path}")
        start, entries, _ = read_header(str(path))
        for name, e in entries.items():
            if name in tensors:
                raise MergerError(f"tensor {name} is stored in two files, {path}")
            copy = PieceCopy(str(path), name, (start + e.begin, e.end - e.begin))
            tensors[name] = SourceTensor(name, e.shape, e.dtype, (ShardPiece((0,) * len(e.shape), e.shape, (copy,)),))
    if not tensors:
        raise MergerError(f"no tensors in the safetensors files, {root}")
    return Catalog(format=fmt, root=root, tensors=tensors, files=[str(f) for f in files],
                   reader_factory=SafetensorsReader, hf_dir=root, details={"files": len(files)})


def open_catalog(root: Path) -> Catalog:
    return catalog_of_files(weight_files(root), root, "hf_safetensors")


class SafetensorsReader:
    """Reads each piece with pread from its planned byte range: nothing stays mapped, so release has no work."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def check_files(self, files: list[str]) -> None:
        for f in files:
            if not Path(f).is_file():
                raise MergerError(f"safetensors file is missing, {f}")

    def read(self, copy: PieceCopy, piece: ShardPiece) -> torch.Tensor:
        begin, length = copy.byte_range
        entry = TensorEntry(copy.key, self.catalog.tensors[copy.key].dtype, piece.sizes, 0, length)
        return read_tensor(copy.file, begin, entry)

    def release(self) -> None:
        pass
