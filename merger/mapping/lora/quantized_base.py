"""A LoRA base stored quantized, as the fold rules read it: an FP8 block-scaled release (DeepSeek-V4's too, its routed
experts FP4), a compressed-tensors release (NVFP4, INT4 `pack-quantized`, MXFP4, MXFP8) or a ModelOpt export (NVFP4,
MXFP8).

The fold rules (fold_steps.py) name the base's tensors and take their shapes and dtypes. A quantized weight is no one
tensor in such a release but its parts (codes and scales), which `merger merge` reads with one step per weight
(fp8.py, compressed_tensors.py, modelopt.py: `release_steps`). Here those steps are the base's `dequantizers`, and
`tensors` shows each weight to the rules as what the step writes: one float32 tensor of the weight's shape, under
the weight's name; the parts, and the calibration beside a weight (no weight: left out as a merge leaves it out),
are not among them, so nothing copies them. `dequantizing_inputs` then makes each step of the fold read such a
weight through its dequantizer: the adapter is folded into the values `merger merge` reads, in float32.

With --dtype keep (`merger lora`'s default) the mapping is written like the release (policy.py's --quantize_like):
a weight no adapter changed holds the release's own values, so it keeps the release's bytes (release_blocks.py), and
what an adapter changed is quantized by the producing tool's rule, shared scales as the release shares them
(DeepSeek-V4: transformers' Fp8Quantize for its FP8 weights, DeepSeek's FP4 rule for its experts: fp8_quantize.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ...catalog import Catalog, SourceTensor
from ...hf_folder import read_config
from ...io import location
from .. import compressed_tensors, fp8, modelopt
from ..compressed_tensors_scheme import COMPRESSED_TENSORS
from ..modelopt_scheme import MODELOPT, MODELOPT_CONFIG, described
from ..quantized_formats import FP8_BLOCK, QUANTIZATION_CONFIG, fp4_experts, fp8_block_config, stored_format
from ..steps import DEQUANTIZED, Step


@dataclass(frozen=True)
class BaseWeights:
    """A base's tensors as the fold rules read them, the steps that dequantize its quantized weights (by the weight's
    name; none for a plain base), what the log calls its format, and its files no plain output may copy."""

    tensors: dict[str, SourceTensor]
    dequantizers: dict[str, Step]
    described: str | None = None
    files_left_out: tuple[str, ...] = ()


def _steps(base: Catalog, folder: Path, config: dict) -> tuple[list[Step], str, tuple[str, ...]] | None:
    """(the steps `merger merge` reads the release with, its format as the log names it, its files left out of a
    plain output), or None for a base that is not quantized (or gpt-oss's MXFP4 experts, kept as stored)."""
    stored = stored_format(folder, config, base.tensors)
    if stored == FP8_BLOCK:
        qc = fp8_block_config(config)
        what = "a DeepSeek-V4 release (FP8 with FP4 experts)" if fp4_experts(qc) else "an FP8 block-scaled release"
        return fp8.release_steps(base.tensors, qc, folder / "config.json"), what, ()
    if stored == COMPRESSED_TENSORS:
        return (compressed_tensors.release_steps(base.tensors, config)[0],
                f"a compressed-tensors {config[QUANTIZATION_CONFIG]['format']} release", ())
    if stored == MODELOPT:
        algo = described(folder, config)[0]["quant_algo"]
        return modelopt.release_steps(base.tensors, folder, config)[0], f"a ModelOpt {algo} export", (MODELOPT_CONFIG,)
    return None


def base_weights(base: Catalog) -> BaseWeights:
    """The weights of base model `base` (a HF folder's catalog) as the fold rules read them; a quantized format the
    fold cannot read is refused (quantized_formats.py)."""
    folder = location(base.root)
    found = _steps(base, folder, read_config(folder))
    if found is None:
        return BaseWeights(dict(base.tensors), {})
    steps, described, left_out = found
    dequantizers = {s.outputs[0].name: s for s in steps if not s.is_cast}
    # in the release's order; a dequantized weight's pieces are its codes', whose file names it in errors
    tensors = {s.outputs[0].name: base.tensors[s.inputs[0]] if s.is_cast else
               SourceTensor(s.outputs[0].name, s.outputs[0].shape, DEQUANTIZED, base.tensors[s.inputs[0]].pieces)
               for s in steps}
    return BaseWeights(tensors, dequantizers, described, left_out)


def _dequantized_first(read: tuple[Step | None, ...], transform, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`transform` of the step's inputs, each one read through its dequantizer (`read`, None for the others) from
    its parts, which stand in `tensors` where the weight would."""
    inputs, at = [], 0
    for dequantizer in read:
        if dequantizer is None:
            inputs.append(tensors[at])
            at += 1
        else:
            inputs += dequantizer.run(tensors[at:at + len(dequantizer.inputs)])
            at += len(dequantizer.inputs)
    return inputs if transform is None else transform(inputs)


def dequantizing_inputs(steps: list[Step], dequantizers: dict[str, Step]) -> list[Step]:
    """`steps` over a base's weights (BaseWeights.tensors) reading each quantized weight from its parts, dequantized
    before the step's own transform."""
    out = []
    for step in steps:
        read = tuple(dequantizers.get(name) for name in step.inputs)
        if not any(read):
            out.append(step)
            continue
        inputs = tuple(n for name, d in zip(step.inputs, read) for n in (d.inputs if d is not None else (name,)))
        out.append(Step(inputs, step.outputs, partial(_dequantized_first, read, step.transform)))
    return out
