"""Write a tiny transformers `mxfp8` release, quantized by transformers itself.

    python -m tests.writers.mxfp8_release --out DIR [--reference DIR]

A seeded tiny transformers Llama in bfloat16 whose attention and MLP linear weights are quantized by transformers'
own `Fp8Quantize` under `FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=[1, 32], scale_fmt="ue8m0")`:
`<m>.weight` float8_e4m3fn and `<m>.weight_scale_inv` the float8_e8m0fnu scale it returns, stored as its bytes
(uint8 [out, in / 32]) as transformers' MXFP8 checkpoints hold them (its loader reads uint8 scales as
2^(byte - 127)). lm_head, embeddings and norms stay bfloat16 (lm_head in modules_to_not_convert, transformers'
default skip). Saved by save_pretrained, that quantization_config in config.json. Every dim is a multiple of 32:
transformers quantizes whole blocks only. transformers cannot quantize while loading on CPU (its FP8 quantizer
wants a GPU there), hence its quantize op called on each weight. `--reference DIR`: the model unquantized.
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
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def mxfp8_config() -> transformers.FineGrainedFP8Config:
    return transformers.FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=[1, 32], scale_fmt="ue8m0",
                                             modules_to_not_convert=["lm_head"])


def transformers_quantized(name: str, weight: torch.Tensor, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' quantize op on weight `name`: (float8_e4m3fn weight, its e8m0 scales as bytes)."""
    op = Fp8Quantize(SimpleNamespace(quantization_config=config or mxfp8_config()))
    out = op._quantize_one(name, weight)
    scale = out[name.removesuffix("weight") + "weight_scale_inv"]
    assert scale.dtype == torch.float8_e8m0fnu, scale.dtype
    return out[name], scale.view(torch.uint8)


def write_release(folder: Path, reference: Path | None = None) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16)
    if reference is not None:
        model.save_pretrained(reference)
    state = {}
    for name, t in model.state_dict().items():
        if name.split(".")[-2] in QUANTIZED:
            state[name], state[name.removesuffix("weight") + "weight_scale_inv"] = transformers_quantized(name, t)
        else:
            state[name] = t
    model.config.quantization_config = mxfp8_config()
    model.save_pretrained(folder, state_dict=state)
    return folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reference", type=Path, help="also save the unquantized model (bfloat16) here")
    args = p.parse_args()
    print(write_release(args.out, args.reference))


if __name__ == "__main__":
    main()
