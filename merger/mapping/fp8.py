"""FP8 block-scaled HF releases (DeepSeek-V3/R1, Qwen3-FP8, ...) written back as a plain model.

Such a release stores each quantized weight `W` as float8 beside `W_scale_inv` (`<module>.weight_scale_inv`):
one float per block of `weight_block_size` [b0, b1] elements of the last two dims, the factor that turns the
stored values back into the weight: w[i, j] = q[i, j] * scale_inv[i // b0, j // b1]. The last block of a row
or column may be partial, so the scale grid is ceil(rows / b0) x ceil(cols / b1). config.json names the
scheme in `quantization_config` (`quant_method: "fp8"`, transformers' FineGrainedFP8Config).

Each quantized weight is one step reading the weight and its scale (both small: one byte per weight element),
dequantized in float32 where it is written; the policy then casts it to --dtype. Tensors without a scale
(norms, embeddings, modules_to_not_convert) are cast as usual. `quantization_config` leaves config.json: the
output holds no quantized weight. Under `--dtype keep` the dequantized weights are written in float32, the
dtype the dequantization computes in (so `merger test` compares them with a reference in its own dtype);
float8 is written again only by --quantize_like (fp8_quantize.py). A LoRA folded into such a release reads its
weights through `dequantizing_inputs`, the same dequantization before the fold.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch

from ..catalog import Catalog, SourceTensor
from ..errors import MergerError
from ..options import MergeOptions
from .hf import model_config
from .quantized_formats import FP8_BLOCK, QUANTIZATION_CONFIG, SCALE_SUFFIX, fp8_block_config, stored_format
from .saved_names import rename_outputs, saved_names
from .steps import DEQUANTIZED, FLOAT8, Mapping, OutputSpec, Step, cast


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """HF names stored as an FP8 block-scaled release. Asked before plain HF names, so this is where a HF-named
    checkpoint's quantized format is decided (quantized_formats.py): one merger does not read is refused here."""
    if catalog.naming != "hf" or options.model not in ("auto", "hf"):
        return False
    try:
        hf_dir, config = model_config(catalog, options)
    except MergerError:
        return False  # no config: no FP8 release; the hf mapper says what is missing
    return stored_format(hf_dir, config, catalog.tensors) == FP8_BLOCK


def dequantize(block: tuple[int, int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[weight, scale_inv] -> [weight * scale_inv of its block] in float32, one block row at a time (in
    place: beside the float32 result only one row of scales is held)."""
    weight, scale = tensors
    b0, b1 = block
    out = weight.to(DEQUANTIZED)
    cols = out.shape[-1]
    for i in range(scale.shape[-2]):
        rows = out[..., i * b0:(i + 1) * b0, :]
        row_scale = scale[..., i, :].to(DEQUANTIZED).repeat_interleave(b1, dim=-1)[..., :cols]
        rows.mul_(row_scale.unsqueeze(-2))
    return [out]


def block_size(qc: dict, where) -> tuple[int, int]:
    block = qc["weight_block_size"]
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MergerError(f"quantization_config.weight_block_size is {block!r}, not two positive integers, {where}")
    return block[0], block[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _check_scale(name: str, tensors: dict[str, SourceTensor], block: tuple[int, int]) -> SourceTensor:
    """The scale of quantized weight `name`, checked against it."""
    weight, scale = tensors[name], tensors[name + SCALE_SUFFIX]
    if weight.dtype not in FLOAT8:
        raise MergerError(f"tensor {name} has a block scale but is stored as {str(weight.dtype).removeprefix('torch.')}"
                          f", not float8, {weight.file}")
    if len(weight.shape) < 2 or scale.shape != scale_shape(weight.shape, block):
        want = list(scale_shape(weight.shape, block)) if len(weight.shape) >= 2 else "a weight of 2 dims or more"
        raise MergerError(f"scale {scale.name} is {list(scale.shape)}, but weight {name} {list(weight.shape)} in "
                          f"blocks of {block[0]}x{block[1]} needs {want}, {scale.file}")
    if not scale.dtype.is_floating_point:
        raise MergerError(f"scale {scale.name} is stored as {str(scale.dtype).removeprefix('torch.')}, not as "
                          f"floats, {scale.file}")
    return scale


def _dequantize_step(name: str, catalog: Catalog, block: tuple[int, int]) -> Step:
    scale = _check_scale(name, catalog.tensors, block)
    return Step((name, scale.name), (OutputSpec(name, catalog.tensors[name].shape, DEQUANTIZED),),
                partial(dequantize, block))


def _dequantized_first(block: tuple[int, int], quantized: tuple[bool, ...], transform, tensors: list[torch.Tensor]
                       ) -> list[torch.Tensor]:
    """`transform` of the step's inputs, each quantized one (followed by its scale in `tensors`) dequantized."""
    inputs, i = [], 0
    for q in quantized:
        inputs.append(dequantize(block, tensors[i:i + 2])[0] if q else tensors[i])
        i += 1 + q
    return inputs if transform is None else transform(inputs)


def dequantizing_inputs(steps: list[Step], tensors: dict[str, SourceTensor], block: tuple[int, int]) -> list[Step]:
    """`steps` over an FP8 release's weights (a LoRA folded into its base) reading each quantized weight with its
    scale, dequantized before the step's own transform; what would have been written as float8 is then the
    dequantized float32."""
    out = []
    for step in steps:
        quantized = tuple(name + SCALE_SUFFIX in tensors for name in step.inputs)
        if not any(quantized):
            out.append(step)
            continue
        inputs = tuple(n for name, q in zip(step.inputs, quantized)
                       for n in ((name, _check_scale(name, tensors, block).name) if q else (name,)))
        outputs = tuple(dataclasses.replace(o, dtype=DEQUANTIZED) if o.dtype in FLOAT8 else o for o in step.outputs)
        out.append(Step(inputs, outputs, partial(_dequantized_first, block, quantized, step.transform)))
    return out


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    block = block_size(fp8_block_config(config), hf_dir / "config.json")
    names = catalog.tensors
    steps = []
    for name, t in names.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in names:
                raise MergerError(f"scale {name} has no weight {name.removesuffix(SCALE_SUFFIX)} beside it, {t.file}")
        elif name + SCALE_SUFFIX in names:
            steps.append(_dequantize_step(name, catalog, block))
        elif t.dtype in FLOAT8:
            raise MergerError(f"tensor {name} is stored as {str(t.dtype).removeprefix('torch.')} with no "
                              f"{name + SCALE_SUFFIX} beside it, {t.file}")
        else:
            steps.append(cast(name, name, t.shape, t.dtype))
    count = sum(not s.is_cast for s in steps)
    note = (f"merger: FP8 block-scaled weights (block {block[0]}x{block[1]}), {count} tensors dequantized; "
            f"{QUANTIZATION_CONFIG} left out of config.json")
    kept = [name for name in names if not name.endswith(SCALE_SUFFIX)]
    return Mapping(rename_outputs(steps, saved_names(hf_dir, config, kept, options.trust_remote_code)), hf_dir,
                   config, config_removals=(QUANTIZATION_CONFIG,), notes=(note,))
