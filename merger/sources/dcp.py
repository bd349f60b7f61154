"""torch.distributed.checkpoint (DCP) folders: `.metadata` + `__{rank}_{k}.distcp`, as FSDP2 `dcp.save`,
accelerate (SHARDED_STATE_DICT, `checkpoint-N/pytorch_model_fsdp_0/`) and torchtitan write them.

The catalog comes from `.metadata` alone: every tensor's global shape and dtype, its chunks (N-dimensional
boxes with offsets) and the byte range of each chunk in its .distcp file, where DCP's FileSystemWriter
stores one `torch.save` blob per chunk. A merge rank reads exactly those byte ranges (torch_save_blob.py
finds the tensor in each), nothing else.
Optimizer state and non-tensor entries are skipped; the `model.` nesting accelerate adds is stripped.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import CorruptSourceError, MergerError, SourceError
from ..hf_folder import CONFIG_DIR, config_dir
from .dcp_chunk_table import ChunkTable, TablePieces, check_end, check_stored, load_chunk_table, stored_ends
from .dcp_classes import BytesStorageMetadata, TensorStorageMetadata
from .dcp_metadata import METADATA_FILE
from .dcp_safetensors import DcpSafetensorsReader, holds_safetensors
from .file_reads import SourceFiles
from .torch_save_blob import BlobError, tensor_in_blob

CHUNK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
ACCELERATE_DIR = "pytorch_model_fsdp_0"  # accelerate's FSDP_MODEL_NAME + "_" + model index 0
NESTING = "model"  # accelerate saves {"model": state_dict}; DCP flattens that to "model.<fqn>"
OPTIMIZER_PREFIXES = ("optim", "optimizer")


def _is_dcp_dir(folder: Path) -> bool:
    return (folder / METADATA_FILE).is_file() and any(CHUNK_FILE.fullmatch(p.name) for p in folder.glob("__*.distcp"))


def dcp_dir(root: Path) -> Path | None:
    """The folder holding `.metadata`: root itself, or accelerate's `pytorch_model_fsdp_0/` inside checkpoint-N."""
    for folder in (root, root / ACCELERATE_DIR):
        if _is_dcp_dir(folder):
            return folder
    return None


def detect(root: Path) -> bool:
    return dcp_dir(root) is not None


def _is_optimizer(fqn: str, path: tuple | None) -> bool:
    head = path[0] if path else fqn.split(".", 1)[0]
    return isinstance(head, str) and head in OPTIMIZER_PREFIXES


def _auto_prefix(fqns: list[str], planner_data: dict) -> str:
    """`model.` when accelerate nested the state dict under "model", else nothing.

    DCP's default planner records how it flattened nested dicts (fqn -> path of keys): a nested save has
    path ("model", "<inner fqn>"), which tells it apart from a HF model whose own names start with
    `model.`. Without that record, strip only when every key starts with `model.` (a HF causal LM always
    has a top-level `lm_head`, so its plain state dict never does).
    """
    paths = [planner_data.get(f) for f in fqns]
    if all(isinstance(p, tuple) and len(p) > 1 and p[0] == NESTING for p in paths):
        return NESTING + "."
    if all(p is None for p in paths) and all(f.startswith(NESTING + ".") for f in fqns):
        return NESTING + "."
    return ""


def _select(tensor_fqns: list[str], planner_data: dict, prefix: str | None,
            folder: Path) -> tuple[str, dict[str, str]]:
    """The prefix taken off, and source name -> DCP fqn for the model's tensors."""
    fqns = [f for f in tensor_fqns if not _is_optimizer(f, planner_data.get(f))]
    if not fqns:
        raise MergerError(f"checkpoint holds no model tensors (only optimizer or non-tensor entries), {folder}")
    if prefix is None:
        prefix = _auto_prefix(fqns, planner_data)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    chosen = {f[len(prefix):]: f for f in fqns if f.startswith(prefix)}
    if not chosen:
        raise MergerError(f"no tensor name starts with --prefix {prefix!r} (names look like {fqns[0]!r}), "
                          f"{folder / METADATA_FILE}")
    return prefix, chosen


def _file_order(path: str) -> tuple[int, int]:
    m = CHUNK_FILE.fullmatch(Path(path).name)
    return (int(m.group(1)), int(m.group(2))) if m else (1 << 62, 0)


def _pieces(table: ChunkTable, chosen: dict[str, str], metadata, folder: Path) -> dict[str, TablePieces]:
    """Each chosen tensor's pieces (name -> its chunks in the table), every one checked to have a readable storage
    entry. FSDP2 saves an empty chunk for ranks past the end of a short dim: nothing to place, left out."""
    files = [str(folder / p) for p in table.paths]
    pieces = {}
    for name, fqn in chosen.items():
        meta = metadata.state_dict_metadata[fqn]
        start, stop = table.spans[fqn]
        rows = np.arange(start, stop)
        if 0 not in meta.size:
            rows = rows[(table.sizes[rows, :len(meta.size)] != 0).all(axis=1)]
        check_stored(table, fqn, rows, len(meta.size), folder)
        pieces[name] = TablePieces(table, rows, len(meta.size), fqn, files)
    return pieces


def open_catalog(root: Path, prefix: str | None = None) -> Catalog:
    folder = dcp_dir(root)
    if folder is None:
        raise SourceError(f"no DCP checkpoint (.metadata + __*_*.distcp) here or in {ACCELERATE_DIR}/, {root}")
    metadata, table = load_chunk_table(folder)
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    tensor_fqns = [f for f, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    prefix, chosen = _select(tensor_fqns, planner_data, prefix, folder)
    pieces = _pieces(table, chosen, metadata, folder)
    tensors = {}
    for name, fqn in chosen.items():
        meta = metadata.state_dict_metadata[fqn]
        tensors[name] = SourceTensor(name, tuple(int(s) for s in meta.size), meta.properties.dtype, pieces[name])
    rows = np.concatenate([p.rows for p in pieces.values()]) if pieces else np.zeros(0, np.int64)
    ends = {str(folder / name): end for name, end in stored_ends(table, rows).items()}
    files = sorted(ends, key=_file_order)
    skipped = sum(1 for m in metadata.state_dict_metadata.values() if isinstance(m, BytesStorageMetadata))
    skipped += len(tensor_fqns) - len(chosen)
    # FileSystemWriter(serialization_format=SAFETENSORS) stores chunks in safetensors form: its own reader.
    reader = DcpSafetensorsReader if holds_safetensors(tensors) else partial(DcpReader, ends)
    return Catalog(
        format="dcp", root=folder, tensors=tensors, files=files, reader_factory=reader,
        check_file=partial(check_end, ends),
        # `huggingface/` inside the DCP folder or the given folder, or beside the DCP folder
        hf_dir=config_dir(folder / CONFIG_DIR, root / CONFIG_DIR, folder.parent / CONFIG_DIR),
        details={"saved_by_ranks": len({_file_order(f)[0] for f in files}),
                 "chunks": sum(len(t.pieces) for t in tensors.values()),
                 "stripped_prefix": prefix or "none", "skipped_entries": skipped},
    )


def chunk_stored(files: SourceFiles, copy: PieceCopy) -> Stored:
    """Where the tensor one DCP chunk holds lies (its byte range is a torch.save blob), from the blob's directory."""
    offset, length = copy.byte_range
    try:
        view, record = tensor_in_blob(files.range_file(copy.file, offset, length), length)
    except BlobError as e:
        raise CorruptSourceError(f"tensor {copy.key}: chunk at byte {offset} is not a torch.save blob of a tensor "
                                 f"({e}), {copy.file}") from e
    record = replace(record, start=offset + record.start)
    return Stored(copy.file, record.start, view, record)


class DcpReader:
    """Locates each chunk in its .distcp file; the stream copies it out, checking the blob's CRC-32. `ends`: the
    byte after the last chunk .metadata places in each file (open_catalog's, from the arrays: at 2.9 M chunks,
    going piece by piece on every rank took seconds)."""

    def __init__(self, ends: dict[str, int], catalog: Catalog):
        self.ends = ends
        self.files = SourceFiles()

    def check_files(self, files: list[str]) -> None:
        for file in files:  # again when opened: planned from .metadata, the file may have been cut since
            check_end(self.ends, file)

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        return chunk_stored(self.files, copy)
