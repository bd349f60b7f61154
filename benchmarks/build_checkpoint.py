"""Write a multi-GB fp32 FSDP2 checkpoint without ever holding the model. Run under torchrun.

The model is built on the meta device and sharded with fully_shard; `to_empty` then allocates only this
rank's shard, which is filled with random values and saved, with the HF config in `huggingface/`:
- `--format fsdp` (verl's layout): `torch.save(model.state_dict())` as `model_world_size_{W}_rank_{r}.pt`
  plus `fsdp_config.json`;
- `--format dcp`: `dcp.save(model.state_dict())` into the folder (`.metadata` + `__{r}_{i}.distcp`, `--files_per_rank`
  of them, as DCP's FileSystemWriter splits a rank's items by size among its threads), with `huggingface/` inside it,
  where merger's dcp backend looks for the config.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def bench_config(layers: int, hidden: int) -> transformers.LlamaConfig:
    # At hidden 2048: ~51M parameters a layer plus 131M of embeddings, so 7 layers ~ 2 GB fp32 and
    # 19 layers ~ 4.5 GB fp32. Smaller hidden sizes keep the same shape ratios (for quick validation runs).
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                    num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                    num_key_value_heads=hidden // 128, tie_word_embeddings=False)


def size_parser() -> argparse.ArgumentParser:
    """The arguments every benchmark checkpoint builder takes: where, how many layers, how wide."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size, a multiple of 128")
    return p


def finish_megatron_save(out: Path, hf: transformers.PretrainedConfig) -> None:
    """The end of the Megatron builders, once every rank has saved its rank files: rank 0 makes `out` a
    Megatron-LM save dir (its tracker file) and writes the HF config into out/huggingface/ last (run.py's sign of
    a complete checkpoint), then every rank leaves the group."""
    from megatron.core import parallel_state as ps

    from tests.writers.leave_group import leave_group

    dist.barrier()
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("1")
        hf.save_pretrained(out / "huggingface")
    ps.destroy_model_parallel()
    leave_group()


def main() -> None:
    p = size_parser()
    p.add_argument("--format", choices=("fsdp", "dcp"), default="fsdp")
    p.add_argument("--files_per_rank", type=int, default=1, help="dcp: data files each rank writes")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = bench_config(args.layers, args.hidden)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0, 0.02)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.format == "dcp":
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(args.out, thread_count=args.files_per_rank))
    else:
        torch.save(model.state_dict(), args.out / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        hf = args.out / "huggingface"
        hf.mkdir(exist_ok=True)
        config.save_pretrained(hf)
        if args.format == "fsdp":
            (args.out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
