"""Write a tensor-parallel torch.distributed.checkpoint of a tiny transformers Llama. Run under torchrun.

    torchrun --nproc_per_node 2 -m tests.writers.dcp_tp_checkpoint --out DIR --hidden 512

Every rank builds the same seeded model and applies torch's own tensor parallelism to each decoder layer as
torchtitan's Llama plan does: q/k/v and gate/up column-wise (DTensor Shard(0)), o and down row-wise (Shard(1):
each rank holds a block of columns), then `dcp.save(model.state_dict())` under gloo into DIR/checkpoint with
`huggingface/` (config + tokenizer) inside. Rank 0 writes the oracle, the unsharded model's own
`save_pretrained` output, to DIR/reference.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_model, save_hf_folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=512, help="wide enough that column blocks are long runs")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = int(os.environ["RANK"])
    model = build_model("llama", hidden=args.hidden)
    if rank == 0:
        save_hf_folder(model, args.out / "checkpoint" / "huggingface")
        model.save_pretrained(args.out / "reference")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    dcp.save(model.state_dict(), checkpoint_id=args.out / "checkpoint")
    leave_group()


if __name__ == "__main__":
    main()
