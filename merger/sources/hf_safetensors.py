"""A HF safetensors folder as a source: `*.safetensors` files whose names are already HF names.

verl's Megatron workers may save the weights this way, into `huggingface/` beside a `dist_ckpt/` that then
holds no model tensors; merging re-shards, casts and copies the config like any other source. Every tensor
is one piece whose bytes the header locates exactly, read with pread.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError
from ..safetensors_io import TensorEntry, read_header, read_tensor


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def detect(root: Path) -> bool:
    return bool(weight_files(root)) and (root / "config.json").is_file()


def open_catalog(root: Path, format_root: Path | None = None) -> Catalog:
    """Catalog of `root`'s safetensors files; `format_root` is the folder the user named, if another."""
    files = weight_files(root)
    if not files:
        raise MergerError(f"no .safetensors files, {root}")
    tensors = {}
    for path in files:
        data_start, entries, _ = read_header(str(path))
        for name, e in entries.items():
            if name in tensors:
                raise MergerError(f"tensor {name} appears in two safetensors files, {path}")
            copy = PieceCopy(str(path), name, (data_start + e.begin, e.end - e.begin))
            tensors[name] = SourceTensor(name, e.shape, e.dtype, (ShardPiece((0,) * len(e.shape), e.shape, (copy,)),))
    return Catalog(format="hf_safetensors", root=format_root or root, tensors=tensors,
                   files=[str(p) for p in files], reader_factory=SafetensorsReader, hf_dir=root,
                   details={"weights": str(root)})


class SafetensorsReader:
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def check_files(self, files: list[str]) -> None:
        for file in files:
            read_header(file)  # validates the header against the file's size again on this rank

    def read(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> torch.Tensor:
        start, length = copy.byte_range
        return read_tensor(copy.file, start, TensorEntry(copy.key, dtype, piece.sizes, 0, length))

    def release(self) -> None:
        pass
