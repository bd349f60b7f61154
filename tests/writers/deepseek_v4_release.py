"""Write a tiny DeepSeek-V4 release as DeepSeek ships V4: transformers' own `deepseek_v4` model saved by
`save_pretrained` (its names mix HF's and DeepSeek's: `attn.wq_a`, `ffn.experts.E.w1`), then its dense linear
weights stored as FP8 (e4m3) in 128x128 blocks and its routed experts as FP4 (two e2m1 codes an int8 byte, the even
element in the low nibble) in blocks of 1x32, every scale a power of two stored as float8_e8m0fnu beside its weight
as `<weight>_scale_inv`, and config.json's quantization_config as FORMATS.md gives DeepSeek-V4's.

    python -m tests.writers.deepseek_v4_release --out DIR [--float4]

`--float4` stores the experts as torch's float4_e2m1fn_x2 (safetensors' F4) instead of int8: the same bytes.

The codes are this writer's own rounding (transformers has no FP4 quantizer): what a reader must get back is what
the release's bytes say, which transformers' dequantizer (`Fp8Dequantize`) reads, not how they were chosen. Dense
weights that are not whole 128x128 blocks, norms, the router and the hyper-connections stay bfloat16, as in the
release.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

# Sizes that make the attention's and shared experts' projections whole 128x128 blocks and the experts' rows whole
# blocks of 32; two layers, two routed experts a token of four.
TINY = dict(vocab_size=256, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, q_lora_rank=128, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, o_groups=2, o_lora_rank=128, index_n_heads=2, index_head_dim=64, index_topk=8,
            num_nextn_predict_layers=0, qk_rope_head_dim=64, sliding_window=16, hc_mult=2)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                       "activation_scheme": "dynamic", "expert_dtype": "fp4"}
BLOCK, FP4_BLOCK = 128, 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX, E2M1_MAX = 448.0, 6.0
SCALE = "_scale_inv"


def _power_of_two_above(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at or above each element of `x` (1 where it is 0)."""
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x))), torch.ones_like(x))


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = _power_of_two_above(blocks.abs().amax(dim=(1, 3)) / E4M3_MAX)
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return codes, scale.to(torch.float8_e8m0fnu)


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
    scale = _power_of_two_above(groups.abs().amax(dim=-1) / E2M1_MAX)
    scaled = groups / scale[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)  # the nearest e2m1 magnitude
    codes = (magnitude | (scaled < 0).long() << 3).reshape(rows, cols).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def _fp8(name: str, t: torch.Tensor) -> bool:
    """The attention's and shared experts' projections in whole blocks."""
    linear = name.endswith(".weight") and t.dim() == 2 and (".attn." in name or ".shared_experts." in name)
    return linear and t.shape[0] % BLOCK == 0 and t.shape[1] % BLOCK == 0


def write_release(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY)).to(torch.bfloat16)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    release = {}
    for name, t in tensors.items():
        if ".ffn.experts." in name and name.endswith(".weight"):
            release[name], release[name + SCALE] = fp4_rows(t)
        elif _fp8(name, t):
            release[name], release[name + SCALE] = fp8_blocks(t)
        else:
            release[name] = t
    save_file(release, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def with_float4_experts(release: Path, folder: Path) -> Path:
    """A copy of `release` in `folder` whose FP4 experts are torch's float4_e2m1fn_x2 (safetensors' F4, which counts
    the codes: a header's last dim twice int8's) instead of int8: the same bytes."""
    tensors = load_file(release / "model.safetensors")
    folder.mkdir(parents=True, exist_ok=True)
    for file in release.iterdir():
        if file.name != "model.safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    save_file({n: t.view(torch.float4_e2m1fn_x2) if t.dtype == torch.int8 and n + SCALE in tensors else t
               for n, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--float4", action="store_true")
    args = p.parse_args()
    release = write_release(args.out)
    print(with_float4_experts(release, release) if args.float4 else release)


if __name__ == "__main__":
    main()
