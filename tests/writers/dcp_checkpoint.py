"""Write a real torch.distributed.checkpoint (DCP) checkpoint of a tiny transformers model. Run under torchrun.

    torchrun --nproc_per_node 4 -m tests.writers.dcp_checkpoint --out DIR [--hsdp 2,2]

Every rank builds the same seeded model, shards it with torch's `fully_shard` (FSDP2) and `dcp.save`s it
under gloo, twice:
- DIR/plain: `dcp.save(model.state_dict())` over a 1-D mesh of all ranks, as an FSDP2 training script does,
  with `huggingface/` (config + tokenizer) inside;
- DIR/checkpoint-1/pytorch_model_fsdp_0: `{"model": get_model_state_dict(model)}` over a 2-D HSDP mesh, the
  call accelerate's `save_fsdp_model` makes for SHARDED_STATE_DICT, plus an `optimizer` entry (Adam state)
  that a merge must skip. Its config + tokenizer go to DIR/hf (accelerate writes none beside it).
Rank 0 writes the oracle, the unsharded model's own `save_pretrained` output, to DIR/reference.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_model, save_hf_folder


def shard(model, mesh):
    """FSDP2 as training scripts apply it: each decoder layer, then the root (a 2-D mesh makes it HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def optimizer_state(model):
    """A real Adam state (exp_avg, step...) for every parameter; lr=0 leaves the weights bit-identical."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return get_optimizer_state_dict(model, opt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True, help="root folder for both checkpoints and the oracle")
    p.add_argument("--hsdp", default="2,2", help="mesh of the accelerate checkpoint: 'R,S' replicas x shards")
    p.add_argument("--arch", default="llama")
    args = p.parse_args()

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if rank == 0:
        model = build_model(args.arch)
        save_hf_folder(model, args.out / "plain" / "huggingface")  # found by default, inside the DCP folder
        save_hf_folder(model, args.out / "hf")  # accelerate's folder has none: passed by flag
        model.save_pretrained(args.out / "reference")  # the oracle: the model's own weights, by transformers

    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    # The same seeded model twice: plain FSDP2 over all ranks, then accelerate's nested form on an HSDP mesh.
    model = build_model(args.arch)
    shard(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    dcp.save(model.state_dict(), checkpoint_id=args.out / "plain")

    replicas, shards = (int(x) for x in args.hsdp.split(","))
    model = build_model(args.arch)
    shard(model, init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("ddp", "fsdp")))
    state = {"model": get_model_state_dict(model), "optimizer": optimizer_state(model)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(args.out / "checkpoint-1" / "pytorch_model_fsdp_0"))
    leave_group()


if __name__ == "__main__":
    main()
