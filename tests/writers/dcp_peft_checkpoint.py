"""Write an accelerate adapter-only DCP checkpoint of a PEFT LoRA model. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.dcp_peft_checkpoint --out DIR

What HF Trainer does at a checkpoint for a PEFT model trained with FSDP2 and SHARDED_STATE_DICT: accelerate's own
`save_fsdp_model(fsdp_plugin, accelerator, model, "DIR/output/checkpoint-1", adapter_only=True)`, which calls
`get_peft_model_state_dict` and `dcp.save({"model": ...})` into `checkpoint-1/pytorch_model_fsdp_0/`, and writes no
adapter config. accelerate only turns FSDP on for GPUs (on CPU its Accelerator falls back to DDP), so the model is
sharded here with torch's `fully_shard` per decoder layer and then the root, as accelerate's `fsdp2_prepare_model`
does with a transformer auto-wrap policy; the Accelerator (cpu=True) sets up the gloo group, and the plugin is a
real FullyShardedDataParallelPlugin(fsdp_version=2, SHARDED_STATE_DICT).

The adapter: r=4 with down_proj at r=2 (rank_pattern), an Embedding adapter (PEFT then also saves the embedding's
base layer), modules_to_save on the final norm, init_lora_weights=False so B is not zero. Rank 0 writes, before
sharding: `base/` (the base model, save_pretrained, with config + tokenizer) and the oracle in `reference/`:
`adapter/` (PEFT's save_pretrained of the unsharded adapter), `merged/` (merge_and_unload, save_pretrained) and
`logits.pt` (the unmerged PEFT model on TOKENS).
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import peft
import torch

from tests.writers.leave_group import leave_group
from tests.writers.peft_adapters import TOKENS
from tests.writers.tiny_models import build_model, save_hf_folder

R, ALPHA = 4, 16
TARGETS = ["q_proj", "v_proj", "down_proj", "embed_tokens"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    accelerator = Accelerator(cpu=True)  # under torchrun: the gloo process group
    model = build_model("llama")
    if accelerator.is_main_process:
        model.save_pretrained(args.out / "base")
        save_hf_folder(model, args.out / "base")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, rank_pattern={"down_proj": 2},
                             modules_to_save=["model.norm"], init_lora_weights=False, task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # the trained copy of a modules_to_save module differs from the original
        wrapped.base_model.model.model.norm.modules_to_save["default"].weight.add_(0.5)
    if accelerator.is_main_process:
        reference = args.out / "reference"
        wrapped.save_pretrained(reference / "adapter")
        with torch.no_grad():
            torch.save(wrapped(TOKENS).logits, reference / "logits.pt")
        copy.deepcopy(wrapped).merge_and_unload().save_pretrained(reference / "merged")

    mesh = init_device_mesh("cpu", (accelerator.num_processes,), mesh_dim_names=("fsdp",))
    for layer in wrapped.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(wrapped, mesh=mesh)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, accelerator, wrapped, args.out / "output" / "checkpoint-1", adapter_only=True)
    leave_group()


if __name__ == "__main__":
    main()
