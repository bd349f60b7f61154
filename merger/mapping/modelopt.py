"""ModelOpt's NVFP4 and MXFP8 exports (`export_hf_checkpoint`, `hf_quant_config.json`) written back as a plain
model.

A quantized Linear layer `<m>` is stored as its codes in `<m>.weight` itself (NVFP4: uint8, two e2m1 codes a byte;
MXFP8: float8_e4m3fn), `<m>.weight_scale` (NVFP4: float8 per 16 elements; MXFP8: e8m0 bytes per 32) and NVFP4's
`<m>.weight_scale_2` (a float32 scalar, shared within q/k/v and within gate/up). Each becomes one step reading its
parts and writing `<m>.weight` dequantized in float32 as ModelOpt's own dequantizer computes it
(compressed_tensors_codec.py); the policy then casts it to --dtype. Which layers are quantized is read off the
files (a `weight_scale` beside the weight) and checked against the export's `exclude_modules`. `<m>.input_scale`
(the activations' calibration) and an FP8 KV cache's `k_scale` and `v_scale` are no weights: left out, counted in
the note. `quantization_config` leaves config.json and `hf_quant_config.json` is not copied: the output holds no
quantized weight, and either would make a loader read its plain weights as ModelOpt's.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

import torch

from ..catalog import Catalog, SourceTensor
from ..errors import MergerError
from ..options import MergeOptions
from . import compressed_tensors_codec as codec
from .compressed_tensors import (SCALE, Reader, dequantized_mapping, dequantized_note, dequantizing_steps,
                                 hf_stored_format)
from .hf import model_config
from .modelopt_scheme import KV_SCALES, MODELOPT, MODELOPT_CONFIG, READ, described
from .quantized_formats import QUANTIZATION_CONFIG
from .steps import Mapping, Step

INPUT_SCALE = "input_scale"  # the activations' calibration: read by no step, written nowhere
READERS = {
    "NVFP4": Reader("weight", torch.uint8, 2, torch.float8_e4m3fn, "weight_scale_2", torch.float32,
                    codec.modelopt_nvfp4, extra_shape=()),
    "MXFP8": Reader("weight", torch.float8_e4m3fn, 1, torch.uint8, None, None, codec.mxfp8),
}


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """HF names stored as a ModelOpt export merger reads (asked after fp8.claims, which has refused the algorithms
    merger does not read)."""
    return hf_stored_format(catalog, options) == MODELOPT


def _check_excluded(names: dict[str, SourceTensor], excluded: list[str], where) -> None:
    """No quantized layer is one the export says it left out (its exclude_modules, names or fnmatch patterns)."""
    for name, t in names.items():
        if name.endswith(f".{SCALE}"):
            module = name.removesuffix(f".{SCALE}")
            pattern = next((p for p in excluded if fnmatchcase(module, p)), None)
            if pattern is not None:
                raise MergerError(f"tensor {name} quantizes {module}, which {where.name} excludes ({pattern!r}), "
                                  f"{t.file}")


def release_steps(names: dict[str, SourceTensor], hf_dir, config: dict) -> tuple[list[Step], dict[str, int]]:
    """dequantizing_steps of an export's tensors `names` (its folder `hf_dir`, config.json `config`) in the
    algorithm its description names, checked against its exclude_modules: the calibration left out."""
    desc, _, where = described(hf_dir, config)
    algo = desc["quant_algo"]
    group, parts = READ[algo]
    _check_excluded(names, desc.get("exclude_modules") or [], where)
    return dequantizing_steps(names, READERS[algo], group, parts, (INPUT_SCALE, *KV_SCALES))


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    algo = described(hf_dir, config)[0]["quant_algo"]
    group, reader = READ[algo][0], READERS[algo]
    steps, counts = release_steps(catalog.tensors, hf_dir, config)
    left = ", ".join(f"{n} {part}" for part, n in counts.items() if n)
    note = (f"merger: ModelOpt {algo} weights (groups of {group}), {dequantized_note(steps, reader)}"
            f"{f'; {left} (calibration, no weight) left out' if left else ''}"
            f"; {QUANTIZATION_CONFIG} left out of config.json, {MODELOPT_CONFIG} not copied")
    return dequantized_mapping(steps, hf_dir, config, options, note, files_left_out=(MODELOPT_CONFIG,))
