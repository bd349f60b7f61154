"""Quantized releases of 2026's formats as LoRA bases, an adapter, and what PEFT and each producing library make of
them (the oracle of tests/test_lora_quantized_bases.py).

    python -m tests.writers.quantized_lora_bases --out DIR

The tiny Llama of tests/writers/compressed_tensors_release.py, released by the tool that produces each format (one
process: importing ModelOpt takes some 15 s of CPU, paid once per cache entry):
- `DIR/<case>/release/`: compressed-tensors' NVFP4 (the global scale shared as llmcompressor's `oneshot` shares it:
  q/k/v and gate/up), INT4 `pack-quantized`, MXFP4 and MXFP8 (compressed_tensors_release.py), ModelOpt's NVFP4 and
  MXFP8 (modelopt_release.py);
- `DIR/adapter/`: a PEFT LoRA (rsLoRA, init_lora_weights=False, so B is not zero) on q_proj, o_proj, gate_proj and
  down_proj, which leaves k/v and up alone: NVFP4 sets with a member changed and others not;
- `DIR/<case>/peft-merged.safetensors`: PEFT's `merge_and_unload` of the adapter into the release as its library
  dequantizes it in float32 (compressed-tensors' unpacking and `dequantize`; ModelOpt's `NVFP4QTensor` /
  `MXFP8QTensor.dequantize`), every other tensor widened to float32;
- `DIR/<case>/tool.safetensors`: each quantized weight of that merged model quantized by the library's own
  quantizer as it writes the release (compressed-tensors: `generate_gparam`, `compute_dynamic_scales_and_zp` and
  `ModelCompressor` on the model at float32, INT4 at bfloat16, the model's dtype its bfloat16 scales are computed
  in; ModelOpt: `NVFP4QTensor.quantize` with `weights_scaling_factor_2` from the largest amax of q/k/v and of
  gate/up, as its export fuses them, and `MXFP8QTensor.quantize`), under the release's names.
"""
from __future__ import annotations

# ModelOpt is imported where it is used: the test reads this module's constants, and importing ModelOpt takes some
# 15 s of CPU

import argparse
import shutil
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.writers import compressed_tensors_release as ct

# case -> (the producing tool, its format)
CASES = {"ct-nvfp4": ("compressed-tensors", "nvfp4-pack-quantized"), "ct-int4": ("compressed-tensors", "pack-quantized"),
         "ct-mxfp4": ("compressed-tensors", "mxfp4-pack-quantized"), "ct-mxfp8": ("compressed-tensors", "mxfp8-quantized"),
         "mo-nvfp4": ("ModelOpt", "nvfp4"), "mo-mxfp8": ("ModelOpt", "mxfp8")}
TARGETS = ["q_proj", "o_proj", "gate_proj", "down_proj"]
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the layers ModelOpt's export fuses


def _model(state: dict[str, torch.Tensor] | None = None) -> transformers.LlamaForCausalLM:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ct.TINY)).float()
    if state is not None:
        model.load_state_dict({name: t.float() for name, t in state.items()})
    return model


def write_adapter(folder: Path) -> Path:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=TARGETS, init_lora_weights=False)
    peft.get_peft_model(_model(), config).save_pretrained(folder)
    return folder


def peft_merged(dequantized: dict[str, torch.Tensor], adapter: Path) -> dict[str, torch.Tensor]:
    merged = peft.PeftModel.from_pretrained(_model(dequantized), adapter).merge_and_unload()
    return {name: t.detach().contiguous() for name, t in merged.state_dict().items()}


def _modelopt_quantized(merged: dict[str, torch.Tensor], release: dict[str, torch.Tensor], algo: str
                        ) -> dict[str, torch.Tensor]:
    """ModelOpt's quantizer on each weight the release quantizes (one with a weight_scale), NVFP4's
    weight_scale_2 from the largest amax of the layers its export fuses."""
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    modules = [n.removesuffix(".weight_scale") for n in release if n.endswith(".weight_scale")]
    out = {}
    for module in modules:
        weight = merged[f"{module}.weight"]
        if algo == "MXFP8":
            q, scale = MXFP8QTensor.quantize(weight)
            out.update({f"{module}.weight": q._quantized_data, f"{module}.weight_scale": scale})
            continue
        parent, _, leaf = module.rpartition(".")
        fused = next((names for names in FUSED if leaf in names), (leaf,))
        scale_2 = max(NVFP4QTensor.get_weights_scaling_factor_2(merged[f"{parent}.{name}.weight"]) for name in fused)
        q, scale, scale_2 = NVFP4QTensor.quantize(weight, 16, weights_scaling_factor_2=scale_2)
        out.update({f"{module}.weight": q._quantized_data, f"{module}.weight_scale": scale,
                    f"{module}.weight_scale_2": scale_2})
    return out


def write_case(root: Path, case: str, adapter: Path) -> None:
    tool, fmt = CASES[case]
    release = root / "release"
    if tool == "ModelOpt":
        from tests.writers import modelopt_release as mo

        mo.write_release(release, fmt)
        dequantized = load_file(release.with_name("release.oracle-f32.safetensors"))
        dequantized = {n: t for n, t in dequantized.items() if not n.endswith("input_scale")}
    else:
        ct.write_release(release, fmt, shared=ct.SHARED["oneshot"] if fmt.startswith("nvfp4") else ())
        dequantized = ct.dequantized_float32(release)
    merged = peft_merged(dequantized, adapter)
    save_file(merged, root / "peft-merged.safetensors")
    if tool == "ModelOpt":
        quantized = _modelopt_quantized(merged, load_file(release / "model.safetensors"), fmt.upper())
    else:
        dtype = torch.bfloat16 if fmt == "pack-quantized" else torch.float32
        written = ct.write_release(root / "tool", fmt, weights={n: t.to(dtype) for n, t in merged.items()},
                                   shared=ct.SHARED["oneshot"] if fmt.startswith("nvfp4") else (), dtype=dtype)
        quantized = load_file(written / "model.safetensors")
        shutil.rmtree(written)  # its other files are the release's
    save_file({n: t.contiguous() for n, t in quantized.items()}, root / "tool.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    out = p.parse_args().out
    transformers.logging.set_verbosity_error()
    adapter = write_adapter(out / "adapter")
    for case in CASES:
        write_case(out / case, case, adapter)


if __name__ == "__main__":
    main()
