"""Write a real verl-layout FSDP2 checkpoint of a tiny transformers model. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 4 -m tests.writers.fsdp_checkpoint --out DIR --arch llama [--mesh 2,2]

Every rank builds the same seeded model, shards it with torch's `fully_shard` and saves
`model_world_size_{W}_rank_{r}.pt` from `model.state_dict()` (DTensors), as verl's checkpoint manager
does. Rank 0 also writes `fsdp_config.json`, `huggingface/` (config + a small tokenizer) and, outside the
checkpoint, the oracle: the unsharded model's own state dict (`reference/model.safetensors`).
With one process (no torchrun) it saves plain tensors, as a single-GPU verl run does.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import HEADS, build_model, save_hf_folder

REMOTE_CODE = Path(__file__).parent / "remote_code"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (global_step_N/actor)")
    p.add_argument("--reference", type=Path, default=None, help="where the oracle goes (default OUT/../reference)")
    p.add_argument("--arch", default="llama", help="llama, qwen2, gpt2, qwen2_vl, or remote (remote-code Llama)")
    p.add_argument("--head", default="causal-lm", choices=list(HEADS),
                   help="token-cls is a verl critic: its huggingface/ config still names the causal LM, as verl's does")
    p.add_argument("--num-labels", type=int, default=1)
    p.add_argument("--mesh", default=None, help="'W' (fsdp) or 'R,S' (HSDP: R replicas of S shards)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--buffer", action="store_true",
                   help="add a persistent buffer: fully_shard leaves it a plain tensor saved whole by every rank")
    p.add_argument("--no-fsdp-config", action="store_true", help="omit fsdp_config.json, as older verl did")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    model = build_model(args.arch, tied=args.tied, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                        dtype=getattr(torch, args.dtype), seed=args.seed, head=args.head, num_labels=args.num_labels)
    if args.buffer:
        model.model.register_buffer("scale_table", torch.arange(7, dtype=torch.float32) / 7, persistent=True)
    reference = args.reference or args.out.parent / "reference"
    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        if args.head == "token-cls":  # verl saves the config it loaded: the critic's says ...ForCausalLM
            model.config.architectures = [type(model).__name__.replace("ForTokenClassification", "ForCausalLM")]
        save_hf_folder(model, args.out / "huggingface", REMOTE_CODE if args.arch == "remote" else None)
        reference.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(reference)  # the oracle: the model's own weights, by transformers' own writer
        if not args.no_fsdp_config:
            (args.out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))

    if world == 1:
        torch.save(model.state_dict(), args.out / "model_world_size_1_rank_0.pt")
        return

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    if args.mesh and "," in args.mesh:
        replicas, shards = (int(x) for x in args.mesh.split(","))
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    shard_and_save(model, mesh, args.out)
    leave_group()


def shard_and_save(model, mesh, out: Path, keep: Callable[[str], bool] = lambda name: True) -> None:
    """fully_shard each block, then the root, and save this rank's state dict (DTensors) as verl does; `keep`
    filters the names saved, as verl's LoRA-only save does."""
    from torch.distributed.fsdp import fully_shard

    for name, blocks in model.named_modules():  # decoder layers, and a VLM's vision blocks too
        if isinstance(blocks, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks", "h"):
            for layer in blocks:
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {name: t for name, t in model.state_dict().items() if keep(name)}
    torch.save(state, out / f"model_world_size_{dist.get_world_size()}_rank_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
