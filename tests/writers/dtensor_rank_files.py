"""Write the four rank files of a verl FSDP checkpoint whose DTensor layouts fully_shard does not make, with torch's
own DTensor classes. One process (gloo, world 1) builds the DeviceMesh of the 4 ranks without creating their groups.

    python -m tests.writers.dtensor_rank_files --out DIR --case reversed-order|older-torch

The tensor `w` (8 x 4) is split along dim 0 over both dims of a 2 x 2 mesh (Shard(0), Shard(0)). Every rank's
local block is the one torch's own `_compute_local_shape_and_global_offset` gives its coordinate.
- reversed-order: the spec records that mesh dim 1 splits first (shard_order dim 0 over mesh dims (1, 0)); the
  blocks are those of that order (mesh dim 1 takes halves, mesh dim 0 quarters within them).
- older-torch: the default order, each spec pickled without the fields a newer torch added (shard_order,
  use_strided_shard_as_shard_order), as the torch releases before them wrote it.
`reference.pt` beside DIR holds the whole tensor.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

MESH = (2, 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", choices=["reversed-order", "older-torch"], required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = DeviceMesh("cpu", torch.arange(4).view(MESH), mesh_dim_names=("replicas", "shards"), _init_backend=False)
    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    placements = (Shard(0), Shard(0))
    reversed_order = args.case == "reversed-order"
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({"w": full}, args.out.parent / "reference.pt")
    (args.out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    for rank in range(4):
        coord = divmod(rank, MESH[1])
        if reversed_order:
            half = full.chunk(MESH[1])[coord[1]]
            local = half.chunk(MESH[0])[coord[0]]
            order = (ShardOrderEntry(0, (1, 0)),)
        else:
            sizes, offsets = _compute_local_shape_and_global_offset(full.shape, MESH, list(coord), placements)
            local = full[offsets[0]:offsets[0] + sizes[0]]
            order = None
        spec = DTensorSpec(mesh, placements, TensorMeta(full.shape, full.stride(), full.dtype), shard_order=order)
        if not reversed_order:
            del spec.__dict__["shard_order"], spec.__dict__["use_strided_shard_as_shard_order"]
        value = DTensor(local.clone(), spec, requires_grad=False)
        torch.save({"w": value}, args.out / f"model_world_size_4_rank_{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
