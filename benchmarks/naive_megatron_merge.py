"""The baseline for Megatron MoE: what conversion scripts do without merger. Load every legacy rank file whole,
rebuild each full tensor by torch.cat over TP ranks and the experts over EP ranks, rename to HF, and save
the whole state dict in one go, in the source dtype (fp32).

    python benchmarks/naive_megatron_merge.py SAVE_DIR DST

SAVE_DIR is a Megatron-LM save dir as benchmarks/build_megatron_moe_checkpoint.py writes it (Qwen3-MoE,
GroupedMLP experts, any TP and EP, expert TP 1, no PP), with the HF config in SAVE_DIR/huggingface/.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

torch.serialization.add_safe_globals([argparse.Namespace])  # Megatron's `args`; nothing else is unpickled


def load_ranks(save_dir: Path) -> dict[tuple[int, int], dict]:
    """(tp, ep) -> that file's model state dict, every file read whole."""
    it = int((save_dir / "latest_checkpointed_iteration.txt").read_text())
    states = {}
    for folder in sorted((save_dir / f"iter_{it:07d}").glob("mp_rank_*")):
        tp, ep = map(int, re.fullmatch(r"mp_rank_(\d+)_(\d+)", folder.name).groups())
        states[tp, ep] = torch.load(folder / "model_optim_rng.pt", map_location="cpu", weights_only=True)
    return states


def main(save_dir: Path, dst: Path) -> None:
    states = load_ranks(save_dir)
    args = next(iter(states.values()))["args"]
    assert args.expert_tensor_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    hf = json.loads((save_dir / "huggingface" / "config.json").read_text())
    # Attention and dense weights: any file of each TP rank; experts: any file of each EP rank (whole at ETP 1).
    by_tp = [next(s["model"] for (t, _), s in states.items() if t == r) for r in range(args.tensor_model_parallel_size)]
    by_ep = [next(s["model"] for (_, e), s in states.items() if e == r) for r in range(args.expert_model_parallel_size)]
    heads, groups, d, vocab = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["vocab_size"]
    experts_per_rank = args.num_experts // args.expert_model_parallel_size

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in by_tp], dim=dim)

    merged = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[:vocab],
              "lm_head.weight": cat("output_layer.weight", 0)[:vocab],
              "model.norm.weight": by_tp[0]["decoder.final_layernorm.weight"]}
    for n in range(args.num_layers):
        src, out = f"decoder.layers.{n}.", f"model.layers.{n}."
        merged[out + "input_layernorm.weight"] = by_tp[0][src + "input_layernorm.weight"]
        merged[out + "post_attention_layernorm.weight"] = by_tp[0][src + "pre_mlp_layernorm.weight"]
        merged[out + "self_attn.q_norm.weight"] = by_tp[0][src + "self_attention.q_layernorm.weight"]
        merged[out + "self_attn.k_norm.weight"] = by_tp[0][src + "self_attention.k_layernorm.weight"]
        # fused QKV: per query group, its heads' q rows, then one k head and one v head
        qkv = cat(src + "self_attention.linear_qkv.weight", 0)
        q, k, v = qkv.view(groups, (heads // groups + 2) * d, -1).split([heads // groups * d, d, d], dim=1)
        hidden = qkv.shape[-1]
        merged[out + "self_attn.q_proj.weight"] = q.reshape(-1, hidden)
        merged[out + "self_attn.k_proj.weight"] = k.reshape(-1, hidden)
        merged[out + "self_attn.v_proj.weight"] = v.reshape(-1, hidden)
        merged[out + "self_attn.o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", 1)
        merged[out + "mlp.gate.weight"] = by_tp[0][src + "mlp.router.weight"]
        for ep, state in enumerate(by_ep):
            # GroupedMLP: weight1 [H, E_local * 2F] is expert e's [gate; up] transposed, as a memory view per expert
            w1 = state[src + "mlp.experts.weight1"].view(experts_per_rank, hidden, -1)
            w2 = state[src + "mlp.experts.weight2"].view(experts_per_rank, -1, hidden)
            for e in range(experts_per_rank):
                expert = f"{out}mlp.experts.{ep * experts_per_rank + e}."
                gate, up = w1[e].t().chunk(2, dim=0)
                merged[expert + "gate_proj.weight"] = gate
                merged[expert + "up_proj.weight"] = up
                merged[expert + "down_proj.weight"] = w2[e].t()
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in merged.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
