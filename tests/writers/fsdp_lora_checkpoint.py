"""Write a verl-layout FSDP2 checkpoint of a PEFT-wrapped tiny model. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 tests/writers/fsdp_lora_checkpoint.py --out DIR/global_step_1/actor

Every rank builds the same seeded model, wraps it with PEFT (init_lora_weights=False, so B is not zero),
shards it with `fully_shard` and saves `model_world_size_{W}_rank_{r}.pt` from `model.state_dict()`, as verl
does, plus `lora_train_meta.json` and `huggingface/`. Rank 0 also writes the oracle next to the checkpoint:
`reference/base` (the base model, save_pretrained), `reference/merged` (PEFT's merge_and_unload, saved by
save_pretrained) and `reference/logits.pt` (the unmerged PEFT model's logits on TOKENS).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import peft
import torch
import torch.distributed as dist

from fsdp_checkpoint import shard_and_save
from leave_group import leave_group
from peft_adapters import TOKENS
from tiny_models import build_model, save_hf_folder

R, ALPHA = 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    reference = args.out.parent.parent / "reference"

    model = build_model("llama")
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(reference / "base")
        save_hf_folder(model, args.out / "huggingface")
        meta = {"r": R, "lora_alpha": ALPHA, "task_type": "CAUSAL_LM"}
        (args.out / "lora_train_meta.json").write_text(json.dumps(meta))
        (args.out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    torch.manual_seed(1)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, modules_to_save=["model.norm"],
                             init_lora_weights=False, task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # the trained copy of a modules_to_save module differs from the original
        wrapped.base_model.model.model.norm.modules_to_save["default"].weight.add_(0.5)
    if rank == 0:
        with torch.no_grad():
            torch.save(wrapped(TOKENS).logits, reference / "logits.pt")
        copy.deepcopy(wrapped).merge_and_unload().save_pretrained(reference / "merged")

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    shard_and_save(wrapped, mesh, args.out)
    leave_group()


if __name__ == "__main__":
    main()
