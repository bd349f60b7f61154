"""A HF model folder of safetensors (one `model.safetensors` or shards with an index): one piece per tensor.

Used for a HF folder given as the checkpoint (a cast and reshard), for a LoRA base model, and for verl's
Megatron workers that save the weights this way into `huggingface/` beside a `dist_ckpt/` holding none.
Headers alone give every tensor's name, shape, dtype and exact byte range, so reading views that range
in the mapped file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError
from ..safetensors_io import read_header
from .mapped_states import MappedStates, map_file

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
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def detect(root: Path) -> bool:
    return bool(weight_files(root))


def catalog_of_files(files: list[Path], root: Path, fmt: str, hf_dir: Path | None = None) -> Catalog:
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
                   reader_factory=SafetensorsReader, hf_dir=hf_dir or root, details={"files": len(files)})


def open_catalog(root: Path, format_root: Path | None = None) -> Catalog:
    """Catalog of `root`'s weights; `format_root` is the folder the user named when it is another one."""
    return catalog_of_files(weight_files(root), format_root or root, "hf_safetensors", hf_dir=root)


class SafetensorsReader:
    """Views each piece's planned byte range in its mapped file; the stream copies it out, pages handed back."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.maps = MappedStates(map_file)

    def check_files(self, files: list[str]) -> None:
        for f in files:
            if not Path(f).is_file():
                raise MergerError(f"safetensors file is missing, {f}")

    def read(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> torch.Tensor:
        begin, length = copy.byte_range
        return self.maps.bytes_at(copy.file, begin, length).view(dtype).view(piece.sizes)

    def release(self) -> None:
        self.maps.release()
