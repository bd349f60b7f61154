"""Write a real torch.distributed.checkpoint (DCP) checkpoint of a tiny transformers model. Run under torchrun.

    torchrun --nproc_per_node 4 tests/writers/dcp_checkpoint.py --out DIR --hf HF --reference REF \
        [--mesh 2,2] [--layout plain|accelerate]

Every rank builds the same seeded model and shards it with torch's `fully_shard` (FSDP2; a 2-D mesh is
HSDP), then `dcp.save`s it under gloo:
- plain: `dcp.save(model.state_dict())` into OUT, as an FSDP2 training script does;
- accelerate: `{"model": get_model_state_dict(model)}` into OUT/pytorch_model_fsdp_0, the call accelerate's
  `save_fsdp_model` makes for SHARDED_STATE_DICT, plus an `optimizer` entry (Adam state) that a merge must skip.
Rank 0 writes the HF folder (config + tokenizer, no weights) to HF and the oracle, the unsharded model's own
`save_pretrained` output, to REF.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiny_models import build_model, save_hf_folder


def shard(model, world: int, mesh_arg: str | None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh_arg and "," in mesh_arg:
        replicas, shards = (int(x) for x in mesh_arg.split(","))
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
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
    p.add_argument("--out", type=Path, required=True, help="DCP folder (plain) or checkpoint-N folder (accelerate)")
    p.add_argument("--hf", type=Path, required=True, help="where config + tokenizer go")
    p.add_argument("--reference", type=Path, required=True, help="where the oracle goes")
    p.add_argument("--layout", choices=["plain", "accelerate"], default="plain")
    p.add_argument("--mesh", default=None, help="'W' (fsdp) or 'R,S' (HSDP: R replicas of S shards)")
    p.add_argument("--arch", default="llama")
    args = p.parse_args()

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model = build_model(args.arch)
    if rank == 0:
        save_hf_folder(model, args.hf)
        model.save_pretrained(args.reference)  # the oracle: the model's own weights, by transformers' own writer

    dist.init_process_group("gloo")
    shard(model, world, args.mesh)
    if args.layout == "plain":
        dcp.save(model.state_dict(), checkpoint_id=args.out)
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(model), "optimizer": optimizer_state(model)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(args.out / "pytorch_model_fsdp_0"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
