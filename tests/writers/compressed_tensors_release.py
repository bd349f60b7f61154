"""Write a tiny HF release quantized by compressed-tensors itself, saved as llmcompressor saves one.

    python -m tests.writers.compressed_tensors_release --out DIR --format pack-quantized

A seeded tiny transformers Llama (bfloat16, lm_head left out as llmcompressor's recipes leave it) whose Linear
layers get one of the schemes of FORMATS, the ones merger reads: INT4 `pack-quantized` in symmetric groups of 32
(Kimi-K2-Thinking's scheme), and compressed-tensors' own presets for `mxfp4-pack-quantized`, `nvfp4-pack-quantized`
and `mxfp8-quantized`; or of VARIANTS: the NVFP4 preset with activations (W4A4, its `input_global_scale`s written
uncalibrated), and schemes merger refuses: the `mxfp6-pack-quantized` preset, INT4 with zero points. Everything past the model is compressed-tensors' code: `apply_quantization_config` attaches the
scheme, `compute_dynamic_scales_and_zp` computes each weight's scales from its groups' min and max
(`generate_gparam` NVFP4's global scale, from the whole weight's, shared among q/k/v and gate/up as llmcompressor
shares it where a test asks: SHARED), and `ModelCompressor` packs the weights and writes
config.json's quantization_config, in the order its own docstring gives for llmcompressor's save_pretrained. No
calibration data: the weights' own groups give the scales, as for a weights-only (A16) scheme.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             QuantizationStatus, apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam

# hidden and intermediate sizes in whole groups of 32 (MX, INT4) and of 16 (NVFP4)
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
INT4_GROUP_32 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
PARTS = ("weight_packed", "weight", "weight_scale", "weight_shape", "weight_global_scale")  # of any format here
# format -> compressed-tensors' preset scheme (weights only), or the weights' arguments
FORMATS = {"pack-quantized": INT4_GROUP_32, "mxfp4-pack-quantized": "MXFP4A16",
           "nvfp4-pack-quantized": "NVFP4A16", "mxfp8-quantized": "MXFP8A16"}
# NVFP4's global scale as llmcompressor's tools share it (FORMATS.md): oneshot across q/k/v and across gate/up,
# model_free_ptq (0.14.0.1) across q/k/v only where the gate/up are an expert's (its pattern is `mlp.gate_proj`: a
# dense MLP's it shares too, so on a dense Llama this stands for a release that shares q/k/v alone)
SHARED = {"oneshot": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
          "model_free_ptq": (("q_proj", "k_proj", "v_proj"),)}
# what a test calls another scheme -> (its format, the preset or the weights' arguments)
VARIANTS = {"nvfp4 W4A4": ("nvfp4-pack-quantized", "NVFP4"),
            "mxfp6-pack-quantized": ("mxfp6-pack-quantized", "MXFP6A16"),
            "asymmetric pack-quantized": ("pack-quantized", dict(INT4_GROUP_32, symmetric=False))}


def _scheme(preset: str | dict):
    if isinstance(preset, str):
        return preset_name_to_scheme(preset, ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**preset))


@torch.no_grad()
def _share_global_scales(model: torch.nn.Module, shared: tuple[tuple[str, ...], ...]) -> None:
    """llmcompressor's `update_fused_layer_weight_global_scales` (llmcompressor/modifiers/utils/helpers.py; not
    installed here, its rule is one line): each set of sibling layers named in `shared` (q/k/v, gate/up) takes the
    smallest of their NVFP4 global scales."""
    for parent in model.modules():
        for names in shared:
            layers = [getattr(parent, name) for name in names if hasattr(parent, name)]
            if len(layers) == len(names):
                smallest = torch.min(torch.cat([layer.weight_global_scale.data for layer in layers])).reshape([1])
                for layer in layers:
                    layer.weight_global_scale.copy_(smallest)


@torch.no_grad()
def _calibrate(model: torch.nn.Module, shared: tuple[tuple[str, ...], ...] = ()) -> None:
    """Each quantized Linear's weight scales (and NVFP4's global scale, `shared` as llmcompressor shares them), from
    the weight alone."""
    for module in model.modules():
        if hasattr(module, "weight_global_scale"):
            module.weight_global_scale.copy_(generate_gparam(module.weight.amin(), module.weight.amax()))
    _share_global_scales(model, shared)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight = module.weight
        global_scale = getattr(module, "weight_global_scale", None)
        scale, zero_point = compute_dynamic_scales_and_zp(weight, scheme.weights, module, global_scale=global_scale)
        module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))


def write_release(folder: Path, fmt: str, seed: int = 0, weights: dict[str, torch.Tensor] | None = None,
                  shared: tuple[tuple[str, ...], ...] = (), dtype: torch.dtype = torch.bfloat16) -> Path:
    """The tiny Llama quantized in `fmt` (a key of FORMATS or of VARIANTS), saved in `folder`; `weights`: the
    model's weights instead of the seeded ones (a trained model: its state dict); `shared`: NVFP4's sets of sibling
    layers that share a global scale (SHARED), none by default; `dtype`: the model's, which compressed-tensors
    computes the scales in."""
    fmt, preset = VARIANTS.get(fmt, (fmt, FORMATS.get(fmt)))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(dtype)
    if weights is not None:
        model.load_state_dict(weights)
    config = QuantizationConfig(config_groups={"group_0": _scheme(preset)}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    _calibrate(model, shared)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder


def dequantized_float32(release: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' unpacking and `dequantize` in float32 for each quantized weight (one with a
    weight_scale) of the release in `release`; every other tensor as stored. (Its dequantizer asked for float32
    rounds INT4's and NVFP4's products to bfloat16: tests/test_compressed_tensors_read.py.)"""
    qc = json.loads((release / "config.json").read_text())["quantization_config"]
    fmt, args = qc["format"], QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    state = load_file(release / "model.safetensors")
    out = {}
    for module in [n.removesuffix(".weight_scale") for n in state if n.endswith(".weight_scale")]:
        part = {p: state.pop(f"{module}.{p}") for p in PARTS if f"{module}.{p}" in state}
        scale, global_scale = part["weight_scale"].float(), part.get("weight_global_scale")
        if fmt == "pack-quantized":
            codes = unpack_from_int32(part["weight_packed"], 4, part["weight_shape"])
        elif fmt == "mxfp8-quantized":
            codes = part["weight"]
        else:
            packed = part["weight_packed"]
            codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        if fmt.startswith("mx"):
            scale = decompress_mx_scale(part["weight_scale"]).float()
        out[f"{module}.weight"] = dequantize(codes, scale, args=args, dtype=torch.float32, global_scale=global_scale)
    return {**out, **state}


def _checkpoint_model(weights: dict[str, torch.Tensor], linear: list[str]) -> torch.nn.Module:
    """A module holding `weights` under their names: each of `linear` (names of `.weight`s) the weight of an
    nn.Linear of its module's name, as llmcompressor's model_free_ptq makes one for each weight it quantizes
    (`initialize_quantized_linear`); every other tensor a buffer. Modules are made in the names' sorted order."""
    root = torch.nn.Module()
    for name in sorted(weights):
        *path, leaf = name.split(".")
        parent = root
        for part in path[:-1] if name in linear else path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        if name in linear:
            out, cols = weights[name].shape
            layer = torch.nn.Linear(cols, out, bias=False, dtype=weights[name].dtype)
            layer.weight.data.copy_(weights[name])
            parent.add_module(path[-1], layer)
        else:
            parent.register_buffer(leaf, weights[name].clone())
    return root


def compress_checkpoint(folder: Path, weights: dict[str, torch.Tensor], fmt: str, linear: list[str],
                        ignore: list[str], shared: tuple[tuple[str, ...], ...] = ()) -> tuple[dict, dict]:
    """(the tensors, config.json's quantization_config) compressed-tensors writes for a checkpoint's `weights`
    (bfloat16) in `fmt` (a key of FORMATS), its Linear layers `linear` (names of `.weight`s; the modules of `ignore`
    among them left unquantized), NVFP4's global scales shared among the sibling layers of `shared`: the same
    scheme, scales and compressor as write_release, on an nn.Linear per weight (as model_free_ptq quantizes a
    checkpoint without its model class), and the quantization_config `ModelCompressor.update_config` writes into
    `folder`'s config.json (made empty here)."""
    model = _checkpoint_model(weights, linear)
    config = QuantizationConfig(config_groups={"group_0": _scheme(FORMATS[fmt])}, ignore=ignore,
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    _calibrate(model, shared)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    compressor.update_config(folder)
    return ({name: t.contiguous() for name, t in model.state_dict().items()},
            json.loads((folder / "config.json").read_text())["quantization_config"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--format", choices=[*FORMATS, *VARIANTS], default="pack-quantized")
    args = p.parse_args()
    print(write_release(args.out, args.format))


if __name__ == "__main__":
    main()
