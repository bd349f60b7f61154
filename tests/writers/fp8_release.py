"""Write a tiny FP8 block-scaled HF release, as DeepSeek-V3/R1 and Qwen3-FP8 are published.

    python -m tests.writers.fp8_release --out DIR [--block 16 16] [--quant_method fp8] [--family deepseek_v3]
                                        [--scale_fmt ue8m0] [--reference DIR]

A seeded tiny transformers Llama (or DeepSeek-V3: MLA with q-LoRA, a dense first layer, a MoE layer of 4
experts and a shared one) whose linear weights are quantized to float8_e4m3fn with one float32
`<name>_scale_inv` per block of `--block` elements (dims chosen to leave partial edge blocks), config.json
naming the scheme in `quantization_config` as transformers' FineGrainedFP8Config does. Two safetensors shards
with an index, one weight's scale in the other shard than its weight; embeddings, norms and lm_head stay
bfloat16 (lm_head in modules_to_not_convert), DeepSeek's router `mlp.gate.weight` too, and its
`e_score_correction_bias` float32, as DeepSeek-V3's release stores them. `--reference DIR`: the same model
unquantized, saved by save_pretrained in float32.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import shutil

import torch
import transformers
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Dims that leave partial edge blocks in [16, 16]: 40 = 2*16 + 8, 56 = 3*16 + 8, 20 = 16 + 4.
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
# Dims that leave partial edge blocks too; the MoE layer's router and shared expert beside 4 routed experts.
DEEPSEEK = dict(vocab_size=96, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                first_k_dense_replace=1, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj")
KEPT_FP32 = ("e_score_correction_bias",)  # DeepSeek-V3's release stores it in float32
FIRST_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"  # stored in SHARD2, its weight in SHARD1
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def quantize(weight: torch.Tensor, block, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv per block): each block's largest magnitude maps to float8's largest
    (`ue8m0`: the scale rounded up to a power of two, as DeepSeek-V3.1's release stores them)."""
    grid = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    scale, quantized = torch.zeros(grid), torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[rows, cols].abs().max().clamp(min=1e-12) / FP8_MAX
            if ue8m0:
                scale[i, j] = 2.0 ** torch.ceil(torch.log2(scale[i, j]))
            quantized[rows, cols] = (weight[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def _model(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK))
    with torch.no_grad():  # a routing bias whose float32 values bfloat16 cannot hold
        for layer in model.model.layers[DEEPSEEK["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(DEEPSEEK["n_routed_experts"]) / 3)
    return model


def write_release(folder: Path, block, quant_method: str = "fp8", family: str = "llama",
                  reference: Path | None = None, scale_fmt: str | None = None, model_dir: Path | None = None) -> Path:
    """The release in `folder` (created), its blocks `block` [rows, cols]; the model unquantized, in float32, in
    `reference` when given. `model_dir`: the model to release, a HF folder, instead of the seeded tiny one."""
    model = (transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if model_dir
             else _model(family))
    saved = Path(reference or folder.with_name(folder.name + "-float32"))
    model.save_pretrained(saved)  # the names save_pretrained writes (DeepSeek's experts one by one)
    config = model.config
    state = {}
    for file in sorted(saved.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            if name.split(".")[-2] in QUANTIZED:
                state[name], state[name + "_scale_inv"] = quantize(t.float(), block, scale_fmt == "ue8m0")
            else:
                state[name] = t.float() if name.split(".")[-1] in KEPT_FP32 else t.to(torch.bfloat16)
    if reference is None:
        shutil.rmtree(saved)
    folder.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": quant_method, "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    if scale_fmt:
        cfg["quantization_config"]["scale_fmt"] = scale_fmt
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
    p.add_argument("--family", choices=["llama", "deepseek_v3"], default="llama")
    p.add_argument("--reference", type=Path, help="also save the unquantized model here, in float32")
    p.add_argument("--scale_fmt", choices=["ue8m0"], default=None, help="power-of-two scales, said in the config")
    args = p.parse_args()
    print(write_release(args.out, args.block, args.quant_method, args.family, args.reference, args.scale_fmt))


if __name__ == "__main__":
    main()
