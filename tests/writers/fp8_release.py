"""Write a tiny FP8 block-scaled HF release, as DeepSeek-V3/R1 and Qwen3-FP8 are published.

    python -m tests.writers.fp8_release --out DIR [--block 16 16] [--quant_method fp8]

A seeded tiny transformers Llama whose linear weights are quantized to float8_e4m3fn with one float32
`<name>_scale_inv` per block of `--block` elements (dims chosen to leave partial edge blocks), config.json
naming the scheme in `quantization_config` as transformers' FineGrainedFP8Config does. Two safetensors shards
with an index, one weight's scale in the other shard than its weight; embeddings, norms and lm_head stay
bfloat16 (lm_head in modules_to_not_convert).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Dims that leave partial edge blocks in [16, 16]: 40 = 2*16 + 8, 56 = 3*16 + 8, 20 = 16 + 4.
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIRST_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"  # stored in SHARD2, its weight in SHARD1
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def quantize(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv per block): each block's largest magnitude maps to float8's largest."""
    grid = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    scale, quantized = torch.zeros(grid), torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[rows, cols].abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[rows, cols] = (weight[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def write_release(folder: Path, block, quant_method: str = "fp8") -> Path:
    """The release in `folder` (created), its blocks `block` [rows, cols]."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(config)
    state = {}
    for name, t in model.state_dict().items():
        if name.split(".")[-2] in QUANTIZED:
            state[name], state[name + "_scale_inv"] = quantize(t.float(), block)
        else:
            state[name] = t.to(torch.bfloat16)
    folder.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": quant_method, "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: dict[str, dict] = {SHARD1: {}, SHARD2: {}}
    for name, t in state.items():
        second = name.startswith(("model.layers.1.", "model.norm", "lm_head")) or name == FIRST_SCALE
        shards[SHARD2 if second else SHARD1][name] = t.contiguous()
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--block", type=int, nargs=2, default=[16, 16], metavar=("ROWS", "COLS"))
    p.add_argument("--quant_method", default="fp8")
    args = p.parse_args()
    print(write_release(args.out, args.block, args.quant_method))


if __name__ == "__main__":
    main()
