"""Write DCP checkpoints in torch's safetensors serialization format. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.dcp_safetensors_checkpoint --out DIR

Every rank builds the same seeded model, shards it with `fully_shard` (FSDP2) and `dcp.save`s it with
`FileSystemWriter(..., serialization_format=SerializationFormat.SAFETENSORS)`, twice:
- DIR/plain: `model.state_dict()`, with `huggingface/` (config + tokenizer) inside;
- DIR/checkpoint-1/pytorch_model_fsdp_0: `{"model": ..., "optimizer": ...}` as accelerate nests it, with Adam's
  state, whose param_groups are non-tensor entries written as raw bytes before each file's safetensors part,
  and thread_count=2, so each rank writes two files. Its config + tokenizer go to DIR/hf;
- DIR/hf_sharded: `model.state_dict()` through torch's HuggingFaceStorageWriter(save_distributed=True) without
  consolidation: one `shard-{rank}-model-00001-of-00001.safetensors` per rank and no .metadata at all.
Rank 0 writes the oracle, the unsharded model's own `save_pretrained` output, to DIR/reference.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.writers.dcp_checkpoint import optimizer_state, shard
from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_model, save_hf_folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if rank == 0:
        model = build_model("llama")
        save_hf_folder(model, args.out / "plain" / "huggingface")
        save_hf_folder(model, args.out / "hf")
        model.save_pretrained(args.out / "reference")

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build_model("llama")
    shard(model, mesh)
    dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(
        args.out / "plain", serialization_format=SerializationFormat.SAFETENSORS))

    model = build_model("llama")
    shard(model, mesh)
    state = {"model": get_model_state_dict(model), "optimizer": optimizer_state(model)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(
        args.out / "checkpoint-1" / "pytorch_model_fsdp_0", thread_count=2,
        serialization_format=SerializationFormat.SAFETENSORS))
    model = build_model("llama")
    shard(model, mesh)
    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(args.out / "hf_sharded",
                                                                          save_distributed=True))
    leave_group()


if __name__ == "__main__":
    main()
