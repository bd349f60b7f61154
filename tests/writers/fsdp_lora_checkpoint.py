"""Write a verl-layout FSDP2 checkpoint of a PEFT-wrapped tiny model. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.fsdp_lora_checkpoint --out DIR/global_step_1/actor

Every rank builds the same seeded model, wraps it with PEFT (init_lora_weights=False, so B is not zero),
shards it with `fully_shard` and saves `model_world_size_{W}_rank_{r}.pt` from `model.state_dict()`, as verl
does, plus `lora_train_meta.json` and `huggingface/`. Rank 0 also writes the oracle next to the checkpoint:
`reference/base` (the base model, save_pretrained), `reference/merged` (PEFT's merge_and_unload, saved by
save_pretrained), `reference/adapter` (PEFT's save_pretrained of the adapter) and `reference/logits.pt` (the unmerged
PEFT model's logits on TOKENS).

With `--lora-only DIR`, the same launch also writes verl's `checkpoint.save_lora_only=True` saves of the adapters
in LORA_ONLY, each on a fresh copy of the same base: `DIR/<variant>/global_step_1/actor` holds rank files with only
the state dict's `lora_` / `.adapter_` tensors (verl's filter), `lora_train_meta.json` as verl writes it (r, integer
lora_alpha, task_type), `huggingface/` and `fsdp_config.json`; the oracle goes to `DIR/<variant>/reference`:
`adapter/` (PEFT's save_pretrained), `merged/` and `logits.pt`. The base is `reference/base` above.
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

from tests.writers.fsdp_checkpoint import shard_and_save
from tests.writers.leave_group import leave_group
from tests.writers.peft_adapters import TOKENS
from tests.writers.tiny_models import build_model, save_hf_folder

R, ALPHA = 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
# LoRA-only saves: LoraConfig kwargs per variant. verl's filter drops modules_to_save copies, so none here. `plain`
# is what r, lora_alpha and the tensors describe in full; `rslora` (a run that loaded such an adapter through
# lora_adapter_path) needs its adapter_config.json.
LORA_ONLY = {
    "plain": dict(r=R, lora_alpha=ALPHA, target_modules=TARGETS, rank_pattern={"down_proj": 2}),
    "rslora": dict(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                   use_rslora=True, rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"v_proj": 8}),
}


def verl_lora_only(name: str) -> bool:
    """The names verl's FSDP checkpoint manager keeps when save_lora_only is set."""
    return "lora_" in name or ".adapter_" in name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lora-only", type=Path, default=None, help="also write the LORA_ONLY saves under this folder")
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
        wrapped.save_pretrained(reference / "adapter")

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    shard_and_save(wrapped, mesh, args.out)
    for variant, kwargs in LORA_ONLY.items() if args.lora_only else ():
        write_lora_only(args.lora_only / variant, kwargs, mesh, rank)
    leave_group()


def write_lora_only(root: Path, kwargs: dict, mesh, rank: int) -> None:
    out = root / "global_step_1" / "actor"
    model = build_model("llama")
    torch.manual_seed(2)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **kwargs))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_hf_folder(model, out / "huggingface")
        config = wrapped.peft_config["default"]
        meta = {"r": config.r, "lora_alpha": int(config.lora_alpha), "task_type": "CAUSAL_LM"}
        (out / "lora_train_meta.json").write_text(json.dumps(meta))
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": mesh.size()}))
        wrapped.save_pretrained(root / "reference" / "adapter")
        with torch.no_grad():
            torch.save(wrapped(TOKENS).logits, root / "reference" / "logits.pt")
        copy.deepcopy(wrapped).merge_and_unload().save_pretrained(root / "reference" / "merged")
    dist.barrier()  # the folder exists before any rank saves into it
    shard_and_save(wrapped, mesh, out, verl_lora_only)


if __name__ == "__main__":
    main()
