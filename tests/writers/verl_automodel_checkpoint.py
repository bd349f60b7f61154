"""Save a transformers model where and as verl's automodel engine saves it. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.verl_automodel_checkpoint --actor DIR/global_step_N/actor \
        --logits LOGITS

verl's engine (verl/workers/engine/automodel/transformer_impl.py) saves through NeMo Automodel's Checkpointer,
configured with model_save_format="safetensors", save_consolidated=True (every save): save_model(module, actor)
and save_optimizer(optimizer, module, actor, scheduler). NeMo Automodel is not installable here (it pins its own
transformers), so this writer makes the same torch calls its Checkpointer makes
(nemo_automodel/components/checkpoint/checkpointing.py, addons.py), on a tiny Qwen2 with tied embeddings:
- the model's state dict (`get_model_state_dict`, HF names, the tied lm_head left out) through torch's
  HuggingFaceStorageWriter(save_distributed=True) into actor/model/: one shard-*-model-*-of-*.safetensors per rank
  and file index, no .metadata;
- the HF config and generation config into actor/model/.hf_metadata/ with fqn_to_file_index_mapping.json, the
  tensor -> file index mapping (here two files: layer 0 and the embeddings in 1, the rest in 2, as it mirrors a
  two-file original model), and consolidate.sh, Automodel's offline helper script, into actor/model/;
- torch's consolidate_safetensors_files_on_every_rank from actor/model/ into actor/model/consolidated/
  (model-*-of-*.safetensors and model.safetensors.index.json), and the config files copied in beside them;
- {"optim": get_optimizer_state_dict, "sched": scheduler.state_dict()} with dcp.save into actor/optim/.
Every rank builds the same seeded model, shards it with fully_shard and takes one AdamW step; rank 0 writes the
oracle: transformers' own logits of the trained model on TOKENS.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.writers.dcp_checkpoint import shard
from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_model

TOKENS = [[1, 5, 7, 9, 11, 3, 42, 100]]


def file_index(name: str) -> int:
    return 1 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--actor", type=Path, required=True)
    p.add_argument("--logits", type=Path, required=True)
    args = p.parse_args()

    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model = build_model("qwen2", tied=True)
    shard(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for param in model.parameters():  # a real AdamW step from set gradients
        param.grad = torch.full_like(param, 1e-2)
    optimizer.step()
    scheduler.step()
    with torch.no_grad():  # every rank takes part in FSDP's gathers
        logits = model(torch.tensor(TOKENS)).logits
    rank0 = dist.get_rank() == 0

    model_dir, metadata_dir = args.actor / "model", args.actor / "model" / ".hf_metadata"
    consolidated = model_dir / "consolidated"
    state = get_model_state_dict(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    mapping = {name: file_index(name) for name in state}
    if rank0:
        metadata_dir.mkdir(parents=True)
        args.logits.parent.mkdir(parents=True, exist_ok=True)
        torch.save(logits, args.logits)
        (metadata_dir / "config.json").write_text(model.config.to_json_string(use_diff=False))
        (metadata_dir / "generation_config.json").write_text(model.generation_config.to_json_string())
        (metadata_dir / "fqn_to_file_index_mapping.json").write_text(json.dumps(mapping, indent=2, sort_keys=True))
        (model_dir / "consolidate.sh").write_text("#!/usr/bin/env bash\n# Automodel's offline consolidation helper\n")
        consolidated.mkdir()
    dist.barrier()
    writer = HuggingFaceStorageWriter(str(model_dir), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, checkpoint_id=model_dir, storage_writer=writer)
    if rank0:  # the Consolidated HF addon's post_save: the config files, not its own mapping file
        for name in ("config.json", "generation_config.json"):
            (consolidated / name).write_text((metadata_dir / name).read_text())
    consolidate_safetensors_files_on_every_rank(str(model_dir), str(consolidated), mapping)
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer), "sched": scheduler.state_dict()},
             checkpoint_id=args.actor / "optim")
    leave_group()


if __name__ == "__main__":
    main()
