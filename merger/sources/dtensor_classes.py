"""merger's stand-ins for the torch.distributed.tensor classes a verl FSDP rank file's pickle names.

FSDP2 saves each parameter as a DTensor: torch.save pickles it as a tensor subclass rebuilt around its local
shard, with a DTensorSpec (mesh, placements, tensor metadata). Loading it with torch's own classes means
importing the package torch.distributed.tensor, which brings DTensor's sharding rules, torch.fx's symbolic
shapes and sympy: 0.8 s of every verl FSDP merge process on this project's CI machine, for classes merger only
reads fields of. The weights-only unpickler resolves the names in STAND_INS to the classes here instead: the
same names and fields, no behaviour. The mesh stays torch's own DeviceMesh (torch.distributed.device_mesh is
imported with torch), so which rank sits at which mesh coordinate is still computed by torch.

A rank file that names a torch.distributed class not covered here (a torch release that pickles DTensors
another way) is loaded with torch's own classes instead (`classes_for`).
"""
from __future__ import annotations

import importlib
import pickle
import sys
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..io.zip_shadow import zip_shadow

_TENSOR = "torch.distributed.tensor"
_SPEC = "torch.distributed.tensor._dtensor_spec"
_PLACEMENTS = "torch.distributed.tensor.placement_types"


class DTensor(torch.Tensor):
    """A loaded DTensor: its global shape and dtype (the wrapper's own), `_local_tensor` (this rank's shard,
    mapped from the file) and `_spec`. It holds no data of its own: any operation on it is refused."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"merger's DTensor stand-in only describes a saved tensor; it cannot run {func}")

    def __setstate__(self, state) -> None:
        # torch pickles a DTensor's attributes as (__dict__, slots) where DTensor declares slots (recent torch:
        # (None, {_local_tensor, _spec})), else as its __dict__. Other attributes, as torch would set them, say
        # nothing about where the shard lies.
        fields = {}
        for part in state if isinstance(state, tuple) else (state,):
            fields.update(part if isinstance(part, dict) else {})
        local, spec = fields.get("_local_tensor"), fields.get("_spec")
        if not isinstance(local, torch.Tensor) or not isinstance(spec, DTensorSpec):
            raise pickle.UnpicklingError("a DTensor saved without its _local_tensor and _spec")
        self._local_tensor, self._spec = local, spec

    @property
    def placements(self) -> tuple:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh


class DTensorSpec:
    """The mesh, placements and metadata of a DTensor, as BUILD fills in the fields torch's dataclass pickled. An
    older torch wrote no shard_order: fsdp.py reads it with the default order as its default."""


class TensorMeta(NamedTuple):
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class ShardOrderEntry(NamedTuple):
    """Tensor dim `tensor_dim` is split over `mesh_dims`, the first one first."""

    tensor_dim: int
    mesh_dims: tuple[int, ...]


class _Placement:
    """is_shard / is_replicate / is_partial, and str and repr, as torch's placements answer them."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(_Placement):
    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class _StridedShard(_Placement):
    dim: int
    split_factor: int

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


class Replicate(_Placement):
    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


class Partial(_Placement):
    reduce_op: str = "sum"

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


# What torch_load's safe_globals takes: (stand-in, the name torch pickles it under); DeviceMesh is torch's own.
STAND_INS: tuple = (
    (DTensor, f"{_TENSOR}.DTensor"),
    *((c, f"{_SPEC}.{c.__name__}") for c in (DTensorSpec, TensorMeta, ShardOrderEntry)),
    *((c, f"{_PLACEMENTS}.{c.__name__}") for c in (Shard, _StridedShard, Replicate, Partial)),
    (DeviceMesh, "torch.distributed.device_mesh.DeviceMesh"),
)
COVERED = frozenset(name for _, name in STAND_INS)


def classes_for(path: str) -> tuple:
    """The safe_globals to load the rank file `path` with: the stand-ins, or none (torch's own classes, imported
    here, as before them) when the file names a torch.distributed class the stand-ins do not cover, when its pickle
    cannot be scanned for names, or when torch's own are imported already: both would claim the same names, and
    which one the unpickler took would be left to chance."""
    if _TENSOR in sys.modules:
        return ()
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(zip_shadow(path))
    except Exception:  # noqa: BLE001 - a damaged or legacy file: loading it, as before, says what is wrong
        named = None
    if named is None or any(name.startswith("torch.distributed.") and name not in COVERED for name in named):
        importlib.import_module(_TENSOR)  # registers torch's own classes with the unpickler
        return ()
    return STAND_INS


def dtensor_types() -> tuple[type, ...]:
    """The classes a loaded DTensor may have: the stand-in, and torch's own once that is imported."""
    real = sys.modules.get(_TENSOR)
    return (DTensor,) if real is None else (DTensor, real.DTensor)
