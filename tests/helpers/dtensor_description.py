"""A loaded verl rank file as plain values, so what torch's own DTensor classes read and what merger's stand-ins
(merger/sources/dtensor_classes.py) read compare entry by entry, across processes. Imports nothing of
torch.distributed.tensor: the process that loads with the stand-ins must not have it."""
from __future__ import annotations

import hashlib

import torch


def describe(state: dict) -> dict:
    """Each entry of a loaded rank file as plain values (run here and in the fresh process)."""
    described = {}
    for name, value in state.items():
        local = getattr(value, "_local_tensor", value)
        entry = {"class": type(value).__name__, "shape": list(value.shape), "dtype": str(value.dtype),
                 "local": [list(local.shape), str(local.dtype),
                           hashlib.sha256(local.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()]}
        if hasattr(value, "_spec"):
            order = getattr(value._spec, "shard_order", None)
            meta = value._spec.tensor_meta
            entry.update(placements=[repr(p) for p in value.placements], shown=[str(p) for p in value.placements],
                         mesh=value.device_mesh.mesh.tolist(), mesh_dim_names=list(value.device_mesh.mesh_dim_names),
                         shard_order=None if order is None else [[e.tensor_dim, list(e.mesh_dims)] for e in order],
                         tensor_meta=[list(meta.shape), list(meta.stride), str(meta.dtype)])
        described[name] = entry
    return described


def describe_catalog(catalog) -> dict:
    """A catalog's tensors as plain values: shape, dtype, and each piece's box and the files holding it."""
    return {n: [list(t.shape), str(t.dtype), [[list(p.offsets), list(p.sizes), [c.file for c in p.copies]]
                                              for p in t.pieces]]
            for n, t in catalog.tensors.items()}
