"""Write a tiny transformers `mxfp8` release, quantized by transformers itself (or, `--deepseek_v3_1`, FP8 in
blocks of 128x128 with power-of-two scales as DeepSeek-V3.1 ships it).

    python -m tests.writers.mxfp8_release --out DIR [--reference DIR] [--deepseek_v3_1]

A seeded tiny transformers Llama in bfloat16 whose attention and MLP linear weights are quantized by transformers'
own `Fp8Quantize` under `FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=[1, 32], scale_fmt="ue8m0")`:
`<m>.weight` float8_e4m3fn and `<m>.weight_scale_inv` the float8_e8m0fnu scale it returns, stored as its bytes
(uint8 [out, in / 32]) as transformers' MXFP8 checkpoints hold them (its loader reads uint8 scales as
2^(byte - 127)). lm_head, embeddings and norms stay bfloat16 (lm_head in modules_to_not_convert, transformers'
default skip). Saved by save_pretrained, that quantization_config in config.json. Every dim is a multiple of 32:
transformers quantizes whole blocks only. transformers cannot quantize while loading on CPU (its FP8 quantizer
wants a GPU there), hence its quantize op called on each weight. `--reference DIR`: the model unquantized.

`--deepseek_v3_1`: the same op under `FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0")`
(quant_method fp8) on a Llama whose dims are multiples of 128, each scale stored as the float32 power of two it is,
as DeepSeek-V3.1's `weight_scale_inv` are.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from transformers.integrations.finegrained_fp8 import Fp8Quantize

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
# DeepSeek-V3.1's blocks: 2 x 2 and 2 x 3 of them in each weight (head_dim 64)
BLOCKS_128 = dict(TINY, hidden_size=256, intermediate_size=384)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def mxfp8_config() -> transformers.FineGrainedFP8Config:
    return transformers.FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=[1, 32], scale_fmt="ue8m0",
                                             modules_to_not_convert=["lm_head"])


def deepseek_v3_1_config() -> transformers.FineGrainedFP8Config:
    return transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0",
                                             modules_to_not_convert=["lm_head"])


def transformers_quantized(name: str, weight: torch.Tensor, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' quantize op on weight `name`: (float8_e4m3fn weight, its e8m0 scales as bytes)."""
    op = Fp8Quantize(SimpleNamespace(quantization_config=config or mxfp8_config()))
    out = op._quantize_one(name, weight)
    scale = out[name.removesuffix("weight") + "weight_scale_inv"]
    assert scale.dtype == torch.float8_e8m0fnu, scale.dtype
    return out[name], scale.view(torch.uint8)


def _spread_blocks(model: transformers.PreTrainedModel) -> None:
    """Each 128x128 block of each quantized weight times its own factor in [1/2, 2): init draws every block of a
    weight alike, so their largest magnitudes would sit at one place between powers of two; a trained model's
    spread over all of it (and the ue8m0 rule treats a block by where its largest magnitude sits)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.split(".")[-2] in QUANTIZED:
                rows, cols = param.shape[0] // 128, param.shape[1] // 128
                factors = torch.pow(2.0, torch.rand(rows, cols) * 2 - 1)
                param.mul_(factors.repeat_interleave(128, 0).repeat_interleave(128, 1).to(param.dtype))


def write_release(folder: Path, reference: Path | None = None, deepseek_v3_1: bool = False) -> Path:
    torch.manual_seed(0)
    sizes, config = (BLOCKS_128, deepseek_v3_1_config()) if deepseek_v3_1 else (TINY, mxfp8_config())
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).to(torch.bfloat16)
    if deepseek_v3_1:
        _spread_blocks(model)
    if reference is not None:
        model.save_pretrained(reference)
    state = {}
    for name, t in model.state_dict().items():
        if name.split(".")[-2] in QUANTIZED:
            weight, scale = transformers_quantized(name, t, config)
            state[name] = weight
            state[name.removesuffix("weight") + "weight_scale_inv"] = (
                scale.view(torch.float8_e8m0fnu).to(torch.float32) if deepseek_v3_1 else scale)
        else:
            state[name] = t
    model.config.quantization_config = config
    model.save_pretrained(folder, state_dict=state)
    return folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reference", type=Path, help="also save the unquantized model (bfloat16) here")
    p.add_argument("--deepseek_v3_1", action="store_true", help="FP8 in 128x128 blocks, float32 ue8m0 scales")
    args = p.parse_args()
    print(write_release(args.out, args.reference, args.deepseek_v3_1))


if __name__ == "__main__":
    main()
