"""compressed-tensors releases (llmcompressor's NVFP4, INT4 `pack-quantized`, MXFP4 and MXFP8) written back as a
plain model.

A quantized Linear layer `<m>` is stored as parts beside each other (compressed_tensors_scheme.py): its codes
(`<m>.weight_packed`, or MXFP8's float8 `<m>.weight` itself), `<m>.weight_scale`, and per format INT4's
`<m>.weight_shape` or NVFP4's `<m>.weight_global_scale`. Each becomes one step reading its parts and writing
`<m>.weight` dequantized in float32 (compressed_tensors_codec.py); the policy then casts it to --dtype (`keep`
writes float32, as fp8.py does). `weight_shape` is checked against the weight's shape when the step runs; NVFP4's
`input_global_scale` (the activations' calibration, no part of any weight) is left out, counted in the note.
Unquantized tensors (embeddings, norms, lm_head, what the config ignores) are cast as usual, and
`quantization_config` leaves config.json: the output holds no quantized weight. Which layers are quantized is
read off the files, a `weight_scale` beside the codes, as compressed-tensors' own dequantizer reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..catalog import Catalog, SourceTensor
from ..errors import MergerError
from ..options import MergeOptions
from . import compressed_tensors_codec as codec
from .compressed_tensors_scheme import READ
from .hf import model_config
from .quantized_formats import COMPRESSED_TENSORS, QUANTIZATION_CONFIG, stored_format, unquantized_note
from .saved_names import rename_outputs, saved_names
from .steps import DEQUANTIZED, Mapping, OutputSpec, Step, cast

SCALE = "weight_scale"
INPUT_SCALE = "input_global_scale"  # NVFP4's activation calibration: read by no step, written nowhere


@dataclass(frozen=True)
class Reader:
    """How one format's quantized weight is read: its codes' part and dtype, how many weight elements one stored
    element holds, its scale's dtype, the other part a step reads (and its dtype), and the arithmetic."""

    codes: str
    codes_dtype: torch.dtype
    per_element: int
    scale_dtype: torch.dtype | None  # None: any floating dtype (INT4's scale is the model's dtype)
    extra: str | None  # INT4's weight_shape (checked, not computed with), NVFP4's weight_global_scale [1]
    extra_dtype: torch.dtype | None
    dequantize: Callable[..., torch.Tensor]
    extra_shape: tuple[int, ...] = (1,)  # the extra part's shape (weight_shape's: the weight's dims)


SHAPE = "weight_shape"
READERS = {
    "nvfp4-pack-quantized": Reader("weight_packed", torch.uint8, 2, torch.float8_e4m3fn, "weight_global_scale",
                                   torch.float32, codec.nvfp4),
    "pack-quantized": Reader("weight_packed", torch.int32, 8, None, SHAPE, torch.int64, codec.int4),
    "mxfp4-pack-quantized": Reader("weight_packed", torch.uint8, 2, torch.uint8, None, None, codec.mxfp4),
    "mxfp8-quantized": Reader("weight", torch.float8_e4m3fn, 1, torch.uint8, None, None, codec.mxfp8),
}


def hf_stored_format(catalog: Catalog, options: MergeOptions) -> str | None:
    """The quantized format HF names' folder stores them in (quantized_formats.stored_format); None for other
    names or no config (the hf mapper says what is missing)."""
    if catalog.naming != "hf" or options.model not in ("auto", "hf"):
        return None
    try:
        hf_dir, config = model_config(catalog, options)
    except MergerError:
        return None
    return stored_format(hf_dir, config, catalog.tensors)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """HF names stored as a compressed-tensors release merger reads (asked after fp8.claims, which has refused the
    formats merger does not read)."""
    return hf_stored_format(catalog, options) == COMPRESSED_TENSORS


def _dtype(t: SourceTensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checked(module: str, reader: Reader, group: int, tensors: dict[str, SourceTensor]) -> tuple[int, ...]:
    """The shape of quantized weight `<module>.weight`, its parts checked against each other."""
    codes, scale = tensors[f"{module}.{reader.codes}"], tensors[f"{module}.{SCALE}"]
    if codes.dtype != reader.codes_dtype or not codes.shape:
        raise MergerError(f"tensor {codes.name} is {_dtype(codes)} {list(codes.shape)}, but the format stores its "
                          f"codes as {str(reader.codes_dtype).removeprefix('torch.')} of 1 dim or more, {codes.file}")
    shape = (*codes.shape[:-1], codes.shape[-1] * reader.per_element)
    want = (*shape[:-1], shape[-1] // group)
    if shape[-1] % group or scale.shape != want:
        raise MergerError(f"scale {scale.name} is {list(scale.shape)}, but weight {module}.weight {list(shape)} in "
                          f"groups of {group} needs {list(want) if shape[-1] % group == 0 else 'whole groups'}, "
                          f"{scale.file}")
    if scale.dtype != reader.scale_dtype and not (reader.scale_dtype is None and scale.dtype.is_floating_point):
        raise MergerError(f"scale {scale.name} is stored as {_dtype(scale)}, not as the format's "
                          f"{str(reader.scale_dtype or 'floats').removeprefix('torch.')}, {scale.file}")
    if reader.extra is not None:
        extra = tensors.get(f"{module}.{reader.extra}")
        if extra is None:
            raise MergerError(f"quantized weight {module}.weight has no {reader.extra} beside its "
                              f"{reader.codes}, {codes.file}")
        want = (len(shape),) if reader.extra == SHAPE else reader.extra_shape
        if extra.shape != want or extra.dtype != reader.extra_dtype:
            raise MergerError(f"tensor {extra.name} is {_dtype(extra)} {list(extra.shape)}, not "
                              f"{str(reader.extra_dtype).removeprefix('torch.')} {list(want)}, {extra.file}")
    return shape


def _dequantize(reader: Reader, name: str, shape: tuple[int, ...], tensors: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    """[codes, scale] (+ INT4's weight_shape, NVFP4's global scale) -> [the weight in float32]."""
    if reader.extra == SHAPE:
        *tensors, stored = tensors
        if tuple(stored.tolist()) != shape:  # values only the step reads: checked here, where they are
            raise MergerError(f"tensor {name}_shape says {stored.tolist()}, but its weight_packed and weight_scale "
                              f"hold {list(shape)}")
    return [reader.dequantize(*tensors)]


def dequantizing_step(module: str, reader: Reader, group: int, tensors: dict[str, SourceTensor]) -> Step:
    """The step writing quantized weight `<module>.weight` dequantized, from its parts."""
    shape = _checked(module, reader, group, tensors)
    name = f"{module}.weight"
    parts = (reader.codes, SCALE) + ((reader.extra,) if reader.extra else ())
    return Step(tuple(f"{module}.{p}" for p in parts), (OutputSpec(name, shape, DEQUANTIZED),),
                partial(_dequantize, reader, name, shape))


def dequantizing_steps(names: dict[str, SourceTensor], reader: Reader, group: int, parts: tuple[str, ...],
                       left_out: tuple[str, ...]) -> tuple[list[Step], dict[str, int]]:
    """The steps writing a release's tensors `names`: each quantized weight (a `weight_scale` beside its codes)
    dequantized, every other tensor cast, the parts its weight's step reads (`parts`) and those of `left_out` (no
    weight) not written; and how many of each left-out part there were."""
    quantized = {name.removesuffix(f".{SCALE}") for name in names if name.endswith(f".{SCALE}")}
    for module in quantized:
        if f"{module}.{reader.codes}" not in names:
            scale = names[f"{module}.{SCALE}"]
            raise MergerError(f"scale {scale.name} has no {reader.codes} beside it, {scale.file}")
    steps, counts = [], dict.fromkeys(left_out, 0)
    for name, t in names.items():
        module, _, part = name.rpartition(".")
        if part in left_out:
            counts[part] += 1
        elif module in quantized and part == reader.codes:
            steps.append(dequantizing_step(module, reader, group, names))
        elif (part in parts or (part == reader.codes and t.dtype == reader.codes_dtype)) and module not in quantized:
            # codes with no scale (MXFP8's float8 `weight` is its codes): no weight to write
            raise MergerError(f"tensor {name} is part of a quantized weight ({part}) with no {SCALE} beside it, "
                              f"{t.file}")
        elif part not in parts:  # the other parts are read by their weight's step
            steps.append(cast(name, name, t.shape, t.dtype))
    return steps, counts


def dequantized_note(steps: list[Step], reader: Reader) -> str:
    """How many weights `steps` dequantize, from which parts, for the log."""
    count = sum(not s.is_cast for s in steps)
    read_with = " and ".join(p for p in (SCALE, reader.extra) if p)
    return f"{count} tensors dequantized from their {reader.codes} with {read_with}, which are not written"


def dequantized_mapping(steps: list[Step], hf_dir, config: dict, options: MergeOptions, note: str,
                        **fields) -> Mapping:
    """A release's `steps` written under the names the installed transformers saves, config.json without the
    release's quantization_config (the output holds no quantized weight); `fields`: the Mapping's others."""
    written = [o.name for s in steps for o in s.outputs]
    unquantized = unquantized_note([s.inputs[0] for s in steps if s.is_cast])
    return Mapping(rename_outputs(steps, saved_names(hf_dir, config, written, options.trust_remote_code)), hf_dir,
                   config, config_removals=(QUANTIZATION_CONFIG,), notes=(note, unquantized), **fields)


def release_steps(names: dict[str, SourceTensor], config: dict) -> tuple[list[Step], dict[str, int]]:
    """dequantizing_steps of a release's tensors `names` in the format its config.json (`config`) names: the
    activations' calibration left out."""
    fmt = config[QUANTIZATION_CONFIG]["format"]
    args, parts = READ[fmt]
    return dequantizing_steps(names, READERS[fmt], args["group_size"], parts, (INPUT_SCALE,))


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    fmt = config[QUANTIZATION_CONFIG]["format"]
    (args, _), reader = READ[fmt], READERS[fmt]
    steps, counts = release_steps(catalog.tensors, config)
    left_out = counts[INPUT_SCALE]
    note = (f"merger: compressed-tensors {fmt} weights (groups of {args['group_size']}), "
            f"{dequantized_note(steps, reader)}"
            f"{f'; {left_out} {INPUT_SCALE} (activation calibration, no weight) left out' if left_out else ''}"
            f"; {QUANTIZATION_CONFIG} left out of config.json")
    return dequantized_mapping(steps, hf_dir, config, options, note)
