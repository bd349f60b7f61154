"""Megatron torch_dist checkpoints: `metadata.json` (sharded_backend torch_dist), `common.pt` and a DCP folder.

Tensors are stored global and TP-independent (fc1 is cat(gate, up), qkv the global grouped layout).
Homogeneous layers are stacked: `decoder.layers.<rest>` of shape [num_layers, ...], axis 0 the global
layer; other models save per-layer keys. The catalog exposes one source tensor per layer either way:
each stored chunk that covers layer l gives a piece `name[l - chunk offset]` (the chunk's box without
axis 0). The reader loads a chunk's bytes (a `torch.save` blob inside the .distcp file) once per batch
and slices the layer; megatron-core writes one chunk per layer, so this reads no extra bytes there.
`optimizer.*`, `_extra_state` and non-tensor entries are skipped.
"""
from __future__ import annotations

import io
import itertools
import json
import os
import pickle
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError
from ..megatron.keys import split_key, take, with_index
from ..megatron.layout import checkpoint_dir

STACKED = "decoder.layers."
EXPERTS = "mlp.experts.experts."  # SequentialMLP experts, stacked on an expert axis
MODEL_PREFIXES = ("decoder.", "embedding.", "output_layer.")
_DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint.filesystem")


def detect(root: Path) -> bool:
    ckpt, _ = checkpoint_dir(root)
    try:
        meta = json.loads((ckpt / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, torch.Size, dtypes and layouts: `.metadata` is never trusted code."""

    def find_class(self, module: str, name: str):
        if module in _DCP and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(ckpt: Path):
    path = ckpt / ".metadata"
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise MergerError(f"torch_dist checkpoint has no .metadata, {ckpt}") from e
    except Exception as e:  # noqa: BLE001 - damaged or hostile pickles raise many types
        raise MergerError(f"cannot read DCP metadata ({e}), {path}") from e


def holds_model(ckpt: Path) -> bool:
    """False when the checkpoint has no model tensors (verl then wrote HF safetensors beside it)."""
    meta = read_metadata(ckpt)
    return any(fqn.startswith(MODEL_PREFIXES) for fqn in meta.state_dict_metadata)


def _skipped(fqn: str) -> bool:
    return fqn.startswith(("optimizer.", "optim.", "rng_state")) or "_extra_state" in fqn


def _stacked_axes(fqn: str):
    """How many leading axes of a stored tensor are stacked (layer, then expert), and the canonical name
    of one (layer, expert) entry: `decoder.layers.{l}.mlp.experts.local_experts.{e}.<rest>`."""
    layered = fqn.startswith(STACKED) and not fqn[len(STACKED):].split(".")[0].isdigit()
    expert = EXPERTS in fqn

    def name_of(index: tuple[int, ...]) -> str:
        name = f"{STACKED}{index[0]}.{fqn[len(STACKED):]}" if layered else fqn
        if expert:
            head, _, tail = name.partition(EXPERTS)
            name = f"{head}mlp.experts.local_experts.{index[-1]}.{tail}"
        return name

    return int(layered) + int(expert), name_of


def open_catalog(root: Path) -> Catalog:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt, hf_dir = checkpoint_dir(root)
    meta = read_metadata(ckpt)
    storage = {(i.fqn, tuple(i.offset)): s for i, s in meta.storage_data.items() if i.offset is not None}
    pieces: dict[str, list[ShardPiece]] = {}
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, torch.dtype] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if _skipped(fqn) or not isinstance(md, TensorStorageMetadata):
            continue
        axes, name_of = _stacked_axes(fqn)
        for chunk in md.chunks:
            info = storage.get((fqn, tuple(chunk.offsets)))
            if info is None:
                raise MergerError(f"tensor {fqn} chunk at {tuple(chunk.offsets)} has no storage entry, {ckpt}")
            if getattr(info, "transform_descriptors", None):
                raise MergerError(f"tensor {fqn} is stored with transforms {info.transform_descriptors} "
                                  f"(e.g. compression), which merger cannot read, {ckpt}")
            file = str(ckpt / info.relative_path)
            key = f"{fqn}@{info.offset}:{info.length}"
            # One piece per (layer, expert) the chunk covers: its box without the stacked axes.
            for local in itertools.product(*(range(chunk.sizes[k]) for k in range(axes))):
                name = name_of(tuple(chunk.offsets[k] + i for k, i in enumerate(local)))
                copy = PieceCopy(file, with_index(key, local), (info.offset, info.length))
                pieces.setdefault(name, []).append(ShardPiece(tuple(chunk.offsets[axes:]),
                                                              tuple(chunk.sizes[axes:]), (copy,)))
                shapes[name], dtypes[name] = tuple(md.size[axes:]), md.properties.dtype
    if not any(n.startswith(MODEL_PREFIXES) for n in pieces):
        raise MergerError(f"torch_dist checkpoint holds no model weights (decoder.*, embedding.*), {ckpt}")
    tensors = {n: SourceTensor(n, shapes[n], dtypes[n], tuple(p)) for n, p in pieces.items()}
    files = sorted({c.file for t in tensors.values() for p in t.pieces for c in p.copies})
    return Catalog(format="megatron_dist", root=root, tensors=tensors, files=files, reader_factory=DistReader,
                   hf_dir=hf_dir, details={"checkpoint": str(ckpt), "stored_tensors": len(meta.state_dict_metadata)})


class DistReader:
    """Reads a chunk's `torch.save` blob by its byte range (weights_only), kept until `release`."""

    def __init__(self, catalog: Catalog):
        self.blobs: dict[tuple[str, int], torch.Tensor] = {}

    def check_files(self, files: list[str]) -> None:
        for file in files:
            if not os.path.isfile(file):
                raise MergerError(f"DCP data file is missing, {file}")

    def _chunk(self, file: str, offset: int, length: int) -> torch.Tensor:
        if (file, offset) not in self.blobs:
            with open(file, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise MergerError(f"DCP data file is truncated at byte {offset + len(data)}, {file}")
            try:
                value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise MergerError(f"cannot load the chunk at byte {offset} ({e}), {file}") from e
            if not isinstance(value, torch.Tensor):
                raise MergerError(f"the chunk at byte {offset} is a {type(value).__name__}, not a tensor, {file}")
            self.blobs[(file, offset)] = value
        return self.blobs[(file, offset)]

    def read(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> torch.Tensor:
        key, sl = split_key(copy.key)
        offset, length = copy.byte_range
        data = take(self._chunk(copy.file, offset, length), sl)
        if tuple(data.shape) != piece.sizes or data.dtype != dtype:
            raise MergerError(f"chunk of {key.split('@')[0]} is {tuple(data.shape)} {data.dtype}, metadata says "
                              f"{piece.sizes} {dtype}, {copy.file}")
        return data

    def release(self) -> None:
        self.blobs.clear()
