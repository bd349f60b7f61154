"""Write a real torchtitan Llama DCP checkpoint and its HF oracle. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 tests/writers/torchtitan_checkpoint.py --out DIR --hf HF --reference REF

Every rank builds the same seeded tiny torchtitan `Llama3Model` (GQA: 4 query heads, 2 kv heads), shards it
with `fully_shard` and `dcp.save`s `model.state_dict()` into OUT, as torchtitan's checkpointer writes
`checkpoint/step-N/`. Rank 0 writes the HF Llama config of the same shape to HF (torchtitan checkpoints
carry none) and the oracle to REF: torchtitan's own `Llama3StateDictAdapter.to_hf` of the unsharded state dict.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from leave_group import leave_group

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, THETA = 32, 4, 2, 2, 101, 72, 10000.0


def titan_config():
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=llama3._build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=128, theta=THETA, scaling="none")),
    )


def hf_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                    rms_norm_eps=1e-5, rope_theta=THETA, max_position_embeddings=128,
                                    tie_word_embeddings=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--reference", type=Path, required=True)
    args = p.parse_args()

    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = titan_config()
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():  # seeded values everywhere (norms too), the same on every rank
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    if rank == 0:
        hf_config().save_pretrained(args.hf)
        oracle = Llama3StateDictAdapter(config, None).to_hf(model.state_dict())
        args.reference.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in oracle.items()}, args.reference / "model.safetensors")

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=args.out)
    leave_group()


if __name__ == "__main__":
    main()
