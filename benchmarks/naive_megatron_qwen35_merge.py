"""The baseline for Megatron Qwen3.5-MoE: the conversion a user writes by hand without merger. Load every legacy
rank file whole, rebuild each full tensor by torch.cat over TP ranks (section by section where a rank's shard is
several sections) and the experts over EP ranks, split and rename to HF, and save the whole state dict in one
go, in the source dtype (fp32).

    python benchmarks/naive_megatron_qwen35_merge.py SAVE_DIR DST

SAVE_DIR is a Megatron-LM save dir as benchmarks/build_megatron_qwen35_checkpoint.py writes it (HF
qwen3_5_moe_text: Gated DeltaNet and gated full attention layers by config.json's layer_types, routed experts
in SequentialMLP and a gated shared expert, any TP and EP, expert TP 1, no PP), with the HF config in
SAVE_DIR/huggingface/.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from naive_megatron_merge import load_ranks  # benchmarks/, the script's own folder


def main(save_dir: Path, dst: Path) -> None:
    states = load_ranks(save_dir)
    args = next(iter(states.values()))["args"]
    assert args.expert_tensor_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    hf = json.loads((save_dir / "huggingface" / "config.json").read_text())
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    # Dense weights: any file of each TP rank; experts: any file of each EP rank (whole at ETP 1).
    by_tp = [next(s["model"] for (t, _), s in states.items() if t == r) for r in range(tp)]
    by_ep = [next(s["model"] for (_, e), s in states.items() if e == r) for r in range(ep)]
    heads, groups, d, vocab = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["vocab_size"]
    key_heads, value_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    qk, v = key_heads * hf["linear_key_head_dim"], value_heads * hf["linear_value_head_dim"]
    experts_per_rank = hf["num_experts"] // ep

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in by_tp], dim=dim)

    def sections(name: str, sizes: list[int]) -> list[torch.Tensor]:
        """Each TP rank's shard is every section's slice, one after the other: split each rank's, cat each section."""
        pieces = [s[name].split([n // tp for n in sizes], dim=0) for s in by_tp]
        return [torch.cat(section, dim=0) for section in zip(*pieces)]

    merged = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[:vocab],
              "lm_head.weight": cat("output_layer.weight", 0)[:vocab],
              "model.norm.weight": by_tp[0]["decoder.final_layernorm.weight"]}
    for n, layer_type in enumerate(hf["layer_types"]):
        src, out = f"decoder.layers.{n}.", f"model.layers.{n}."
        attn = src + "self_attention."
        merged[out + "input_layernorm.weight"] = by_tp[0][src + "input_layernorm.weight"]
        merged[out + "post_attention_layernorm.weight"] = by_tp[0][src + "pre_mlp_layernorm.weight"]
        if layer_type == "linear_attention":  # Gated DeltaNet: in_proj [q; k; v; z; b; a], conv1d [q; k; v]
            lin = out + "linear_attn."
            q, k, vv, z, b, a = sections(attn + "in_proj.weight", [qk, qk, v, v, value_heads, value_heads])
            merged[lin + "in_proj_qkv.weight"] = torch.cat([q, k, vv])
            merged[lin + "in_proj_z.weight"] = z
            merged[lin + "in_proj_b.weight"] = b
            merged[lin + "in_proj_a.weight"] = a
            merged[lin + "conv1d.weight"] = torch.cat(sections(attn + "conv1d.weight", [qk, qk, v]))
            merged[lin + "A_log"] = cat(attn + "A_log", 0)
            merged[lin + "dt_bias"] = cat(attn + "dt_bias", 0)
            merged[lin + "norm.weight"] = by_tp[0][attn + "out_norm.weight"] + 1  # Megatron's scales by 1 + w
            merged[lin + "out_proj.weight"] = cat(attn + "out_proj.weight", 1)
        else:  # gated attention: per query group its q heads, as many gate heads, one k and one v head
            per = heads // groups
            qkv = cat(attn + "linear_qkv.weight", 0)
            hidden = qkv.shape[-1]
            q, gate, k, vv = qkv.view(groups, 2 * per + 2, d, hidden).split([per, per, 1, 1], dim=1)
            merged[out + "self_attn.q_proj.weight"] = torch.stack([q, gate], dim=2).reshape(-1, hidden)  # [q_h; gate_h]
            merged[out + "self_attn.k_proj.weight"] = k.reshape(-1, hidden)
            merged[out + "self_attn.v_proj.weight"] = vv.reshape(-1, hidden)
            merged[out + "self_attn.o_proj.weight"] = cat(attn + "linear_proj.weight", 1)
            merged[out + "self_attn.q_norm.weight"] = by_tp[0][attn + "q_layernorm.weight"]
            merged[out + "self_attn.k_norm.weight"] = by_tp[0][attn + "k_layernorm.weight"]
        merged[out + "mlp.gate.weight"] = by_tp[0][src + "mlp.router.weight"]
        for rank, state in enumerate(by_ep):
            for e in range(experts_per_rank):
                local = f"{src}mlp.experts.local_experts.{e}."
                expert = f"{out}mlp.experts.{rank * experts_per_rank + e}."
                merged[expert + "gate_proj.weight"], merged[expert + "up_proj.weight"] = (
                    state[local + "linear_fc1.weight"].chunk(2, dim=0))
                merged[expert + "down_proj.weight"] = state[local + "linear_fc2.weight"]
        fc1 = src + "mlp.shared_experts.linear_fc1.weight"  # [gate; up] on each TP rank
        size = by_tp[0][fc1].shape[0] * tp // 2
        merged[out + "mlp.shared_expert.gate_proj.weight"], merged[out + "mlp.shared_expert.up_proj.weight"] = (
            sections(fc1, [size, size]))
        merged[out + "mlp.shared_expert.down_proj.weight"] = cat(src + "mlp.shared_experts.linear_fc2.weight", 1)
        merged[out + "mlp.shared_expert_gate.weight"] = by_tp[0][src + "mlp.shared_experts.gate_weight"]
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in merged.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
