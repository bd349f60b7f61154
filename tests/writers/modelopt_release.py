"""Write a tiny HF export quantized by NVIDIA ModelOpt itself, on CPU, as `export_hf_checkpoint` writes one.

    python -m tests.writers.modelopt_release --out DIR --format nvfp4

The seeded tiny transformers Llama of tests/writers/compressed_tensors_release.py (bfloat16), quantized by
`mtq.quantize` with ModelOpt's preset (`NVFP4_DEFAULT_CFG` or `MXFP8_DEFAULT_CFG`: weights and activations, the
lm_head left out as the presets leave it) over a calibration loop of a few fixed token batches, then written by
`export_hf_checkpoint`: the weights' codes and scales, each quantized layer's activation `input_scale` where the
algorithm has one, config.json's quantization_config and hf_quant_config.json. Everything past the model is
ModelOpt's code. `--kv_cache fp8` adds ModelOpt's FP8 KV-cache preset (`k_scale`, `v_scale`).

Beside the export folder, never inside it (merger reads only the folder), the oracle of tests/test_modelopt_read.py:
`<folder>.oracle-f32.safetensors` and `<folder>.oracle-bf16.safetensors`, ModelOpt's own dequantization of each
quantized weight (one with a weight_scale) in that dtype, its input_scale left out, every other tensor of the export
as stored. ModelOpt's dequantizer runs here, where ModelOpt is imported anyway, and not in the test's process
(importing it there cost some 13 s of CPU per run): `NVFP4QTensor(shape, dtype, weight).dequantize(scale=
weight_scale, double_scale=weight_scale_2, block_sizes={-1: 16})` or `MXFP8QTensor(...).dequantize(scale=
weight_scale)`, the algorithm the one this writer was asked for (the one hf_quant_config.json names, checked).
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
import transformers
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant
from safetensors.torch import load_file, save_file

from tests.writers.compressed_tensors_release import TINY

PRESETS = {"nvfp4": "NVFP4_DEFAULT_CFG", "mxfp8": "MXFP8_DEFAULT_CFG"}
# the oracle's dtypes by the names of its files, <folder>.oracle-<name>.safetensors
ORACLE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CALIBRATION = torch.randint(TINY["vocab_size"], (3, 2, 8), generator=torch.Generator().manual_seed(1))


def _config(fmt: str, kv_cache: str | None) -> dict:
    config = copy.deepcopy(getattr(mtq, PRESETS[fmt]))
    if kv_cache == "fp8":  # ModelOpt's own way of adding a KV-cache scheme to a preset (as its hf_ptq example)
        config = update_quant_cfg_with_kv_cache_quant(config, mtq.FP8_KV_CFG["quant_cfg"])
    return config


@torch.no_grad()
def _calibrate(model: torch.nn.Module) -> None:
    for tokens in CALIBRATION:
        model(tokens)


def _export(folder: Path, fmt: str, kv_cache: str | None, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The tiny Llama (its seeded weights, or `weights`) quantized by ModelOpt in `fmt`, exported into `folder`."""
    # architectures as save_pretrained would write them: ModelOpt's export reads them off the live config
    config = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    if weights is not None:
        model.load_state_dict(weights)
    mtq.quantize(model, _config(fmt, kv_cache), _calibrate)
    export_hf_checkpoint(model, export_dir=folder)


def trained(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model of `weights` (bfloat16) after "training", as tests/test_modelopt_nvfp4_write.py describes it:
    every quantized weight of layer 0 plus a seeded random delta; the smallest-magnitude element of layer 1's
    q_proj plus 0.01; one element of layer 1's gate_proj set to four times the largest magnitude of its gate/up."""
    weights = dict(weights)
    torch.manual_seed(3)
    for name in sorted(n for n in weights if n.startswith("model.layers.0.") and n.endswith("_proj.weight")):
        weights[name] = weights[name] + (torch.randn(weights[name].shape) / 500).to(weights[name].dtype)
    q, gate = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    weights[q], weights[gate] = weights[q].clone(), weights[gate].clone()
    weights[q][divmod(int(weights[q].abs().argmin()), weights[q].shape[1])] += 0.01
    weights[gate][0, 0] = 4 * max(weights[gate].abs().max(), weights[gate.replace("gate", "up")].abs().max())
    return weights


def write_release(folder: Path, fmt: str, seed: int = 0, kv_cache: str | None = None) -> Path:
    """The tiny Llama quantized by ModelOpt in `fmt` (a key of PRESETS), exported into `folder`. For NVFP4 without
    a KV cache, beside it too: `<folder>.trained.safetensors`, the model ModelOpt's bfloat16 dequantization of the
    export gives after `trained`, and `<folder>.trained/`, ModelOpt's export of that model (the oracle of
    tests/test_modelopt_nvfp4_write.py)."""
    torch.manual_seed(seed)
    _export(folder, fmt, kv_cache)
    algo = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    assert algo == fmt.upper(), (algo, fmt)
    for key, dtype in ORACLE_DTYPES.items():
        save_file(oracle(folder, dtype, algo), folder.with_name(f"{folder.name}.oracle-{key}.safetensors"))
    if algo == "NVFP4" and kv_cache is None:
        weights = trained(oracle(folder, torch.bfloat16, algo))
        save_file(weights, folder.with_name(f"{folder.name}.trained.safetensors"))
        _export(folder.with_name(f"{folder.name}.trained"), fmt, None, weights)
    return folder


def oracle(folder: Path, dtype: torch.dtype, algo: str) -> dict[str, torch.Tensor]:
    """ModelOpt's dequantization of each quantized weight (one with a weight_scale) of the export in `folder`, in
    `dtype`, as `algo` (NVFP4, MXFP8) reads it; its input_scale left out; every other tensor as stored."""
    state = load_file(folder / "model.safetensors")
    nvfp4 = algo == "NVFP4"
    out = {}
    for module in [n.removesuffix(".weight_scale") for n in state if n.endswith(".weight_scale")]:
        weight, scale = state.pop(f"{module}.weight"), state.pop(f"{module}.weight_scale")
        state.pop(f"{module}.input_scale", None)
        if nvfp4:
            shape = torch.Size((*weight.shape[:-1], weight.shape[-1] * 2))
            out[f"{module}.weight"] = NVFP4QTensor(shape, dtype, weight).dequantize(
                dtype=dtype, scale=scale, double_scale=state.pop(f"{module}.weight_scale_2"), block_sizes={-1: 16})
        else:
            out[f"{module}.weight"] = MXFP8QTensor(weight.shape, dtype, weight).dequantize(dtype=dtype, scale=scale)
    return {name: tensor.contiguous() for name, tensor in {**out, **state}.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--format", choices=list(PRESETS), default="nvfp4")
    p.add_argument("--kv_cache", choices=["fp8"], default=None)
    p.add_argument("--export", action="append", default=[], metavar="NAME:FORMAT[:KV_CACHE]",
                   help="write this export as OUT/NAME instead, as many as given, in one process (importing "
                        "ModelOpt takes some 15 s of CPU)")
    args = p.parse_args()
    for spec in args.export:
        name, fmt, *kv_cache = spec.split(":")
        print(write_release(args.out / name, fmt, kv_cache=kv_cache[0] if kv_cache else None))
    if not args.export:
        print(write_release(args.out, args.format, kv_cache=args.kv_cache))

if __name__ == "__main__":
    main()
