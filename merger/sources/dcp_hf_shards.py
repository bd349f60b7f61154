"""The unconsolidated output of torch's `HuggingFaceStorageWriter(path, save_distributed=True)`.

Every saving rank writes `shard-{rank:05d}-model-{k:05d}-of-{n:05d}.safetensors` with its chunks, under their
DCP fqns, and `__metadata__["DCP_SHARDING_INFO"]` giving each chunk's offsets in the global tensor; there is
no `.metadata`. The catalog comes from the safetensors headers: a tensor's global shape is the furthest extent
of its chunks (as torch's HuggingFaceStorageReader takes it), which must then be covered exactly; chunks saved
by several ranks at the same offsets (replicas) are one piece with several copies. Each piece is a byte range
read at its byte range, like any safetensors tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError, SourceError
from ..hf_folder import CONFIG_DIR, config_dir
from ..safetensors_io import read_header
from .dcp_metadata import METADATA_FILE
from .dcp_safetensors import saved_offsets
from .hf_safetensors import SafetensorsReader

SHARD_FILE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")


def shard_files(root: Path) -> list[Path]:
    """The shard files, ordered by saving rank, then file index."""
    files = [p for p in root.glob("shard-*.safetensors") if SHARD_FILE.fullmatch(p.name)] if root.is_dir() else []
    return sorted(files, key=lambda p: tuple(int(g) for g in SHARD_FILE.fullmatch(p.name).groups()[:2]))


def detect(root: Path) -> bool:
    return not (root / METADATA_FILE).exists() and bool(shard_files(root))


def _tensor(name: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...], object, PieceCopy]],
            root: Path) -> SourceTensor:
    dtypes = {dtype for _, _, dtype, _ in chunks}
    if len(dtypes) > 1:
        raise MergerError(f"tensor {name} is stored as {sorted(map(str, dtypes))} in different files, {root}")
    shape = tuple(max(o[d] + s[d] for o, s, _, _ in chunks) for d in range(len(chunks[0][0])))
    copies: dict[tuple, list[PieceCopy]] = {}
    for offsets, sizes, _, copy in chunks:
        if 0 not in sizes or 0 in shape:  # an empty chunk (a rank past the end of a short dim) places nothing
            copies.setdefault((offsets, sizes), []).append(copy)
    pieces = tuple(ShardPiece(o, s, tuple(c)) for (o, s), c in copies.items())
    covered, total = sum(p.numel for p in pieces), 1
    for s in shape:
        total *= s
    if covered != total:
        raise MergerError(f"tensor {name}: its chunks hold {covered} elements but span a {shape} tensor of {total} "
                          f"(a shard file missing, or overlapping chunks), {root}")
    return SourceTensor(name, shape, dtypes.pop(), pieces)


def open_catalog(root: Path) -> Catalog:
    files = shard_files(root)
    if not files:
        raise SourceError(f"no shard-*-model-*-of-*.safetensors files, {root}")
    # Saving ranks number their files 1..W. A gap means a lost file; a lost last one cannot be seen (nor by torch's
    # reader): nothing records W, and the remaining chunks then span a smaller tensor exactly.
    ranks = sorted({int(SHARD_FILE.fullmatch(f.name).group(1)) for f in files})
    if ranks != list(range(1, len(ranks) + 1)):
        missing = sorted(set(range(1, ranks[-1] + 1)) - set(ranks))
        raise SourceError(f"shard files of saving ranks {missing} are missing (found ranks {ranks[0]}..{ranks[-1]}), "
                          f"{root}")
    chunks: dict[str, list] = {}
    for path in files:
        start, entries, metadata = read_header(str(path))
        offsets = saved_offsets(metadata, str(path))
        for name, e in entries.items():
            if name not in offsets or len(offsets[name]) != len(e.shape):
                raise MergerError(f"tensor {name} has no saved offsets of its rank in DCP_SHARDING_INFO, {path}")
            copy = PieceCopy(str(path), name, (start + e.begin, e.end - e.begin))
            chunks.setdefault(name, []).append((offsets[name], e.shape, e.dtype, copy))
    tensors = {name: _tensor(name, c, root) for name, c in chunks.items()}
    return Catalog(format="dcp_hf", root=root, tensors=tensors, files=[str(f) for f in files],
                   reader_factory=SafetensorsReader,
                   hf_dir=config_dir(root, root / CONFIG_DIR, root.parent / CONFIG_DIR),
                   details={"shard_files": len(files), "chunks": sum(len(t.pieces) for t in tensors.values())})
