"""Megatron torch_dist checkpoints: `metadata.json` (sharded_backend torch_dist), `common.pt` and a DCP folder.

Tensors are stored global and TP-independent (fc1 is cat(gate, up), qkv the global grouped layout).
Homogeneous layers are stacked: `decoder.layers.<rest>` of shape [num_layers, ...], axis 0 the global
layer; other models save per-layer keys. The catalog exposes one source tensor per layer either way:
each stored chunk that covers layer l gives a piece `name[l - chunk offset]` (the chunk's box without
axis 0). The reader loads the chunk (a `torch.save` blob inside the .distcp file) and slices the layer out;
megatron-core writes one chunk per layer, so this reads no extra bytes there.
A tensor stored as one key per section (a Mamba2 or Gated DeltaNet in_proj or conv1d: megatron_sections.py) is
presented whole.
Entries that are not weights (`optimizer.*`, `_extra_state`, stored objects) are left out by the named rules
of megatron_skips.py.
"""
from __future__ import annotations

import itertools
import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError, SourceError
from ..io import is_file
from .dcp import chunk_stored
from .dcp_chunk_table import check_end, check_stored, chunk_rows, load_chunk_table, stored_ends
from .dcp_classes import TensorStorageMetadata
from .dcp_metadata import load_compact
from .file_reads import SourceFiles
from .piece_keys import split_key, take, with_index
from .megatron_layout import checkpoint_dir
from .megatron_sections import section_of
from .megatron_skips import NOT_A_TENSOR, skip_rule

STACKED = "decoder.layers."
EXPERTS = "mlp.experts.experts."  # SequentialMLP experts, stacked on an expert axis
MODEL_PREFIXES = ("decoder.", "embedding.", "output_layer.")
# A vision-language model as Megatron-Bridge and verl's Megatron engine build it (a GPTModel as `language_model`, a
# ViT as `vision_model`): each stacks its own decoder layers
VLM_PREFIXES = ("language_model.", "vision_model.")
STACKS = (STACKED,) + tuple(p + STACKED for p in VLM_PREFIXES)


def detect(root: Path) -> bool:
    ckpt, _ = checkpoint_dir(root)
    try:
        meta = json.loads((ckpt / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


def holds_model(ckpt: Path) -> bool:
    """False when the checkpoint has no model tensors (verl then wrote HF safetensors beside it)."""
    meta, _ = load_compact(ckpt)  # the names alone: no object per chunk
    return any(fqn.startswith(MODEL_PREFIXES + VLM_PREFIXES) for fqn in meta.state_dict_metadata)


def _stacked_axes(fqn: str):
    """How many leading axes of a stored tensor are stacked (layer, then expert), and the canonical name
    of one (layer, expert) entry: `decoder.layers.{l}.mlp.experts.local_experts.{e}.<rest>` (a VLM's under its
    model's prefix)."""
    stack = next((s for s in STACKS if fqn.startswith(s)), "")
    layered = bool(stack) and not fqn[len(stack):].split(".")[0].isdigit()
    expert = EXPERTS in fqn

    def name_of(index: tuple[int, ...]) -> str:
        name = f"{stack}{index[0]}.{fqn[len(stack):]}" if layered else fqn
        if expert:
            head, _, tail = name.partition(EXPERTS)
            name = f"{head}mlp.experts.local_experts.{index[-1]}.{tail}"
        return name

    return int(layered) + int(expert), name_of


def open_catalog(root: Path) -> Catalog:
    ckpt, hf_dir = checkpoint_dir(root)
    meta, table = load_chunk_table(ckpt)
    files = [str(ckpt / p) for p in table.paths]
    pieces: dict[str, list[ShardPiece]] = {}
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, torch.dtype] = {}
    skipped: dict[str, str] = {}
    used: list[np.ndarray] = []  # the table rows of the tensors merged: the bytes each file must hold
    for fqn, md in meta.state_dict_metadata.items():
        rule = skip_rule(fqn) or (None if isinstance(md, TensorStorageMetadata) else NOT_A_TENSOR)
        if rule:
            skipped[fqn] = rule
            continue
        axes, name_of = _stacked_axes(fqn)
        rows = np.arange(*table.spans[fqn])
        check_stored(table, fqn, rows, len(md.size), ckpt)
        used.append(rows)
        for offsets, sizes, file, (offset, length) in chunk_rows(table, rows, len(md.size)):
            key = f"{fqn}@{offset}:{length}"
            # One piece per (layer, expert) the chunk covers: its box without the stacked axes.
            for local in itertools.product(*(range(sizes[k]) for k in range(axes))):
                name = name_of(tuple(offsets[k] + i for k, i in enumerate(local)))
                copy = PieceCopy(files[file], with_index(key, local), (offset, length))
                pieces.setdefault(name, []).append(ShardPiece(offsets[axes:], sizes[axes:], (copy,)))
                shapes[name], dtypes[name] = tuple(md.size[axes:]), md.properties.dtype
    if not any(n.startswith(MODEL_PREFIXES + VLM_PREFIXES) for n in pieces):
        raise MergerError(f"torch_dist checkpoint holds no model weights (decoder.*, embedding.*), {ckpt}")
    tensors = join_sections({n: SourceTensor(n, shapes[n], dtypes[n], tuple(p)) for n, p in pieces.items()}, ckpt)
    files = sorted({c.file for t in tensors.values() for p in t.pieces for c in p.copies})
    return Catalog(format="megatron_dist", naming="megatron", root=root, tensors=tensors, files=files,
                   reader_factory=DistReader, hf_dir=hf_dir, skipped=skipped,
                   check_file=partial(check_end, {str(ckpt / name): end for name, end in
                                                  stored_ends(table, np.concatenate(used)).items()}),
                   details={"checkpoint": str(ckpt), "stored_tensors": len(meta.state_dict_metadata)})


def join_sections(tensors: dict[str, SourceTensor], ckpt: Path) -> dict[str, SourceTensor]:
    """A Mamba2 or Gated DeltaNet in_proj or conv1d is stored as one tensor per section (megatron_sections.py):
    one tensor again, in the place of its first section, each section's pieces moved down by the rows of the
    sections before it."""
    parts: dict[str, dict[int, SourceTensor]] = {}
    for name, tensor in tensors.items():
        if found := section_of(name):
            parts.setdefault(found[0], {})[found[1]] = tensor
    joined = {}
    for name, tensor in tensors.items():
        found = section_of(name)
        if found is None:
            joined[name] = tensor
            continue
        base, _, count = found
        if base in joined:
            continue
        if sorted(parts[base]) != list(range(count)):
            raise MergerError(f"tensor {base} lacks sections: only {[t.name for t in parts[base].values()]} are "
                              f"stored, {ckpt}")
        start, pieces = 0, []
        for section in (parts[base][j] for j in range(count)):
            pieces += [ShardPiece((p.offsets[0] + start, *p.offsets[1:]), p.sizes, p.copies) for p in section.pieces]
            start += section.shape[0]
        joined[base] = SourceTensor(base, (start, *tensor.shape[1:]), tensor.dtype, tuple(pieces))
    return joined


class DistReader:
    """Locates the chunk a piece lies in (a DCP chunk) and takes the piece's layer out of it."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.files = SourceFiles()

    def check_files(self, files: list[str]) -> None:
        for file in files:
            if not is_file(file):
                raise SourceError(f"DCP data file is missing, {file}")

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        chunk = chunk_stored(self.files, copy)
        return chunk.narrowed(take(chunk.view, split_key(copy.key)[1]))
