"""verl FSDP / FSDP2 checkpoints: `model_world_size_{W}_rank_{r}.pt` files of DTensors or plain tensors.

The catalog needs only rank 0's file: a DTensor records its global shape, its mesh (which global rank sits
at which coordinate) and its placements, which together fix the region every other rank holds. Each merge
rank later opens its own rank files and checks them against that description before any byte is written.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import re
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError, SourceError
from ..io import exists
from ..hf_folder import CONFIG_DIR, config_dir
from .dtensor_classes import classes_for, dtensor_types
from .mapped_states import MappedStates
from .safe_load import check_zip_end, torch_load

RANK_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def detect(root: Path) -> bool:
    return any(RANK_FILE.fullmatch(p.name) for p in root.glob("model_world_size_*_rank_*.pt"))


def _world_size(root: Path) -> int:
    sizes = {int(m.group(1)) for p in root.iterdir() if (m := RANK_FILE.fullmatch(p.name))}
    config = root / "fsdp_config.json"
    if config.is_file():
        try:
            declared = int(json.loads(config.read_text())["world_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise MergerError(f"fsdp_config.json has no readable world_size ({e}), {config}") from e
        if sizes and sizes != {declared}:
            raise MergerError(f"fsdp_config.json says world_size {declared} but the rank files say "
                              f"{sorted(sizes)}, {config}")
        return declared
    if len(sizes) != 1:
        raise MergerError(f"rank files of several world sizes {sorted(sizes)} in one folder, {root}")
    return sizes.pop()


def load_rank_file(path: str) -> dict:
    """A rank's state dict, memory-mapped: no tensor's bytes are read. Its DTensors are merger's stand-ins where
    they cover the file's pickle, else torch's own (dtensor_classes.py)."""
    # Unpickling a DeviceMesh outside its process group warns about torch.compile; we only read its layout.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)

    state = torch_load(path, "rank file", safe_globals=classes_for(path))
    if not isinstance(state, dict):
        raise MergerError(f"rank file holds a {type(state).__name__}, not a state dict, {path}")
    return state


def shard_region(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                 placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the box a mesh coordinate holds; Shard(d) splits like torch.chunk, in mesh-dim order."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            continue
        d, n, k = placement.dim, mesh_shape[mesh_dim], coord[mesh_dim]
        full = math.ceil(sizes[d] / n) if sizes[d] else 0
        start = min(full * k, sizes[d])
        size = max(0, min(sizes[d], start + full) - start)
        offsets[d] += start
        sizes[d] = size
    return tuple(offsets), tuple(sizes)


def _describe_placements(value) -> tuple:
    return tuple(str(p) for p in value.placements)


def _check_placements(name: str, value, path: str) -> None:
    placements = value.placements
    for p in placements:
        if p.is_replicate():
            continue
        if not (p.is_shard() and type(p).__name__ == "Shard"):
            raise MergerError(f"tensor {name} has placement {p}, which merger cannot merge "
                              f"(only Shard(d) and Replicate()), {path}")
        if type(p.dim) is not int or not 0 <= p.dim < value.dim():
            raise MergerError(f"tensor {name} has {value.dim()} dims but placement {p}, {path}")
    # A tensor dim split over several mesh dims is split over them in mesh-dim order (shard_region), unless the
    # spec records another order (newer torch writes the order down): the regions would then be others.
    order = getattr(value._spec, "shard_order", None)
    default = _default_shard_order(placements)
    if order is not None and [(e.tensor_dim, tuple(e.mesh_dims)) for e in order] != default:
        shown = ", ".join(f"dim {e.tensor_dim} over mesh dims {tuple(e.mesh_dims)}" for e in order)
        raise MergerError(f"tensor {name} is split in the order {shown}, not in mesh-dim order, which merger "
                          f"cannot merge, {path}")


def _default_shard_order(placements) -> list[tuple[int, tuple[int, ...]]]:
    """(tensor dim, the mesh dims splitting it, in mesh-dim order) for each split tensor dim, by tensor dim."""
    over: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if p.is_shard():
            over.setdefault(p.dim, []).append(mesh_dim)
    return [(d, tuple(over[d])) for d in sorted(over)]


@functools.lru_cache(maxsize=None)
def _coordinates(mesh_shape: tuple[int, ...], ranks: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate on a mesh (given row-major), computed once per distinct mesh."""
    return {rank: tuple(_unravel(i, mesh_shape)) for i, rank in enumerate(ranks)}


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    coord = []
    for size in reversed(shape):
        index, c = divmod(index, size)
        coord.append(c)
    return coord[::-1]


def _dtensor_pieces(name: str, value, files: list[str], path: str) -> tuple[ShardPiece, ...]:
    _check_placements(name, value, path)
    mesh = value.device_mesh.mesh
    if mesh.numel() != len(files):
        raise MergerError(f"tensor {name} lives on a mesh of {mesh.numel()} ranks but the checkpoint has "
                          f"{len(files)} rank files, {path}")
    coords = _coordinates(tuple(mesh.shape), tuple(mesh.flatten().tolist()))
    regions: dict[tuple, list[PieceCopy]] = {}
    for rank, file in enumerate(files):
        if rank not in coords:
            raise MergerError(f"rank {rank} is not on the mesh of tensor {name}, {path}")
        region = shard_region(tuple(value.shape), tuple(mesh.shape), coords[rank], value.placements)
        if math.prod(region[1]) == 0 and value.numel() > 0:
            continue  # torch.chunk leaves the last ranks empty when a dim is smaller than the mesh
        regions.setdefault(region, []).append(PieceCopy(file, name))
    return tuple(ShardPiece(off, size, tuple(copies)) for (off, size), copies in regions.items())


def open_catalog(root: Path) -> Catalog:
    world = _world_size(root)
    files = [str(root / f"model_world_size_{world}_rank_{r}.pt") for r in range(world)]
    missing = [f for f in files if not exists(f)]
    if missing:
        raise SourceError(f"{len(missing)} of {world} rank files are missing, {missing[0]}")
    state = load_rank_file(files[0])
    tensors, placements, meshes = {}, set(), set()
    dtensor = dtensor_types()
    for name, value in state.items():
        if isinstance(value, dtensor):
            pieces = _dtensor_pieces(name, value, files, files[0])
            placements.add(_describe_placements(value))
            meshes.add((tuple(value.device_mesh.mesh.shape), value.device_mesh.mesh_dim_names))
        elif isinstance(value, torch.Tensor):
            # A plain tensor is either a single-process save or a buffer every rank saved whole: one piece,
            # with a copy in every file, so it is read once and never concatenated.
            copies = tuple(PieceCopy(f, name) for f in files)
            pieces = (ShardPiece((0,) * value.dim(), tuple(value.shape), copies),)
        else:
            continue  # non-tensor entries (e.g. _extra_state bytes) carry no weights
        tensors[name] = SourceTensor(name, tuple(value.shape), value.dtype, pieces)
    if not tensors:
        raise MergerError(f"rank file holds no tensors, {files[0]}")
    return Catalog(
        format="fsdp", root=root, tensors=tensors, files=files, reader_factory=FsdpReader, check_file=check_zip_end,
        hf_dir=config_dir(root / CONFIG_DIR),
        details={"world_size": world,
                 "meshes": sorted(f"{shape} {names}" for shape, names in meshes) or ["none (plain tensors)"],
                 "placements": sorted(str(p) for p in placements)},
    )


class FsdpReader:
    """Reads local shards from the rank files one merge rank opened, checking each against the catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.states = MappedStates(load_rank_file)

    def _expected(self) -> dict[str, dict[str, tuple]]:
        """For each file, the region size every tensor must have there."""
        expected: dict[str, dict[str, tuple]] = {}
        for t in self.catalog.tensors.values():
            for piece in t.pieces:
                for copy in piece.copies:
                    expected.setdefault(copy.file, {})[t.name] = piece.sizes
        return expected

    def check_files(self, files: list[str]) -> None:
        expected = self._expected()
        dtensor = dtensor_types()
        for file in files:
            state = self.states[file]
            for name, tensor in self.catalog.tensors.items():
                value = state.get(name)
                if not isinstance(value, torch.Tensor):
                    raise MergerError(f"tensor {name} is missing from this rank's file, {file}")
                local = value._local_tensor if isinstance(value, dtensor) else value
                if tuple(value.shape) != tensor.shape or value.dtype != tensor.dtype:
                    raise MergerError(f"tensor {name} is {tuple(value.shape)} {value.dtype} here but "
                                      f"{tensor.shape} {tensor.dtype} on rank 0, {file}")
                want = expected.get(file, {}).get(name)
                if want is not None and tuple(local.shape) != want:
                    raise MergerError(f"tensor {name} has local shape {tuple(local.shape)} but its placements "
                                      f"give {want}, {file}")

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        value = self.states[copy.file][copy.key]
        return self.states.stored(copy.file, getattr(value, "_local_tensor", value))
