"""A HF model folder of safetensors (one `model.safetensors` or shards with an index): one piece per tensor.

Used for a HF folder given as the checkpoint (a cast and reshard), for a LoRA base model, and for verl's
Megatron workers that save the weights this way into `huggingface/` beside a `dist_ckpt/` holding none.
Headers alone give every tensor's name, shape, dtype and exact byte range, which is all reading needs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError, SourceError
from ..io import is_file
from ..hf_folder import weight_files
from ..safetensors_io import read_header

def detect(root: Path) -> bool:
    return bool(weight_files(root))


def catalog_of_files(files: list[Path], root: Path, fmt: str, hf_dir: Path | None = None) -> Catalog:
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        if not path.is_file():
            raise SourceError(f"safetensors file is missing, {path}")
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
    """Each piece is its planned byte range, a contiguous tensor (safetensors records no checksum)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def check_files(self, files: list[str]) -> None:
        for f in files:
            if not is_file(f):
                raise SourceError(f"safetensors file is missing, {f}")

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        return Stored(copy.file, copy.byte_range[0], torch.empty(piece.sizes, dtype=dtype, device="meta"))
