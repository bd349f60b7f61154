"""`--quantize_like` an MXFP8 release that stores a weight as `<m>.weight` float8_e4m3fn [out, in] beside
`<m>.weight_scale` uint8 [out, in / 32], an e8m0 byte per group of 32 (the group is its codes times
2^(byte - 127)): compressed-tensors' `mxfp8-quantized` (llmcompressor's MXFP8A16) and ModelOpt's `MXFP8` export.
Both read the same way (compressed_tensors_codec.mxfp8); each producer has its own rule, and the output is quantized
by the release's producer's:

- compressed-tensors 0.20 (`calculate_qparams` with `generate_mx_scales`, then its compressor's `quantize`), on the
  weight at --dtype: per group, amax = max|w| is rounded to a power of two 2^p the way its `round_to_power_2` does
  with FP4's one mantissa bit (up where amax's significand is 1.75 or more, else down), the scale byte is
  127 + p - 8 (8 = floor(log2 448)) clamped to [0, 255] (an all-zero group: 0), and each code is w / 2^(byte - 127)
  clamped to ±448 and cast to float8 (a power of two: the division is exact);
- ModelOpt 0.47 (`MXFP8QTensor.quantize`): transformers' `Fp8Quantize` rule in blocks of 1x32 with ue8m0 scales
  (fp8_quantize.py: amax / 448 rounded up to a power of two), which writes the same bytes (FORMATS.md).

The release's quantization_config goes into config.json, and a ModelOpt export's `hf_quant_config.json` beside it.
Groups whose values are the release's own keep the release's bytes (release_blocks.py), as for FP8: neither rule is
a fixed point on its own output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from ..errors import MergerError
from ..hf_folder import read_config
from . import fp8_quantize
from .compressed_tensors_codec import E8M0_BIAS, mxfp8
from .fp8_release_layout import quantized_here, readable, release_headers
from .quantized_check import E4M3_HALF_STEP
from .quantized_formats import QUANTIZATION_CONFIG
from .release_blocks import StoredTensor, as_read, keep, per_element, unchanged_blocks
from .steps import OutputSpec

MXFP8_QUANTIZED = "mxfp8-quantized"  # compressed-tensors' format
GROUP = 32
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
E4M3_OFFSET = 8  # floor(log2(448)): the group's amax lands in the top binade of float8
SCALE_SUFFIX = "_scale"  # `<m>.weight` -> `<m>.weight_scale`
Rule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def compressed_tensors_scales(groups: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e8m0 scale bytes [..., g], the powers of two they are, float32 [..., g, 1]) of float32 `groups` [..., g, 32]
    by compressed-tensors' MX rule, for codes whose largest binade starts at 2^offset (floor(log2) of the codes'
    largest magnitude: 8 for e4m3, 2 for e2m1)."""
    amax = groups.abs().amax(-1)
    significand, exponent = torch.frexp(amax)  # amax = significand x 2^exponent, significand in [0.5, 1)
    power = exponent - 1 + (significand >= 0.875).to(exponent.dtype)  # 1.75 and up rounds up
    scales = torch.where(amax > 0, (power + E8M0_BIAS - offset).clamp(0, 255), 0).to(torch.uint8)
    return scales, torch.pow(2.0, scales.to(torch.float64) - E8M0_BIAS).to(torch.float32).unsqueeze(-1)


def compressed_tensors_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes [..., n], e8m0 scale bytes [..., n / 32]) of `weight` by compressed-tensors' MXFP8 rule."""
    groups = weight.to(torch.float32).unflatten(-1, (-1, GROUP))  # exact: every --dtype is float32's subset
    scales, factor = compressed_tensors_scales(groups, E4M3_OFFSET)
    codes = torch.clamp(groups / factor, -FP8_MAX, FP8_MAX).to(FP8)
    return codes.flatten(-2), scales


# ModelOpt's MXFP8QTensor.quantize: transformers' rule in 1x32 blocks with ue8m0 scales, stored as e8m0 bytes
modelopt_quantize = partial(fp8_quantize.quantize, (1, GROUP), True, scale_dtype=torch.uint8)


def quantize_keeping(rule: Rule, weight: torch.Tensor, release: tuple[torch.Tensor, torch.Tensor]
                     ) -> list[torch.Tensor]:
    """`rule`, but each group whose values are the release's (read as merger reads them, cast to `weight`'s
    dtype) keeps the release's codes and scale byte."""
    codes, scales = release
    grid = unchanged_blocks(as_read(mxfp8(codes, scales), weight), (1, GROUP))
    if grid.all():  # nothing changed: no quantizing
        return [codes, scales]
    new_codes, new_scales = rule(weight)
    return [keep(per_element(grid, (1, GROUP), tuple(weight.shape)), codes, new_codes), keep(grid, scales, new_scales)]


@dataclass(frozen=True)
class Mxfp8Output:
    """How an MXFP8 output is written: which outputs are quantized (by name), the dtypes the other tensors take
    (the release's), config.json's quantization_config (the release's), the producer's name and rule, the release's
    tensors, whose bytes unchanged groups keep (None: a Hub id's, every group quantized), and files written beside
    config.json (a ModelOpt export's hf_quant_config.json)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    producer: str
    rule: Rule
    release: dict[str, StoredTensor] | None = None
    files: dict[str, str] = field(default_factory=dict)

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        return (dataclasses.replace(spec, dtype=FP8),
                OutputSpec(spec.name + SCALE_SUFFIX, (*spec.shape[:-1], spec.shape[-1] // GROUP), torch.uint8,
                           rows=spec.rows))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        if self.release is None:
            return list(self.rule(tensor))
        return quantize_keeping(self.rule, tensor, (self.release[spec.name].read(spec.rows),
                                                    self.release[spec.name + SCALE_SUFFIX].read(spec.rows)))

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py)."""
        codes, scales = parts
        return mxfp8(codes, scales), mxfp8(torch.full_like(codes, E4M3_HALF_STEP), scales)


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]], producer: str, rule: Rule,
                   files: tuple[str, ...] = ()) -> Mxfp8Output:
    """How to write `outputs` (name -> shape) as the MXFP8 release in `folder` (its format checked by
    config_format) stores them; `files`: the release's files beside config.json that the output gets too."""
    tensors = release_headers(folder)
    quantized = frozenset(name for name, t in tensors.items()
                          if t.dtype == FP8 and name + SCALE_SUFFIX in tensors
                          and tensors[name + SCALE_SUFFIX].dtype == torch.uint8)
    here = quantized_here(quantized, outputs, folder)
    for name in sorted(here):
        if tuple(outputs[name]) != tensors[name].shape:
            raise MergerError(f"tensor {name} is {list(outputs[name])} here but {list(tensors[name].shape)} in the "
                              f"release: --quantize_like needs the release of this model, {folder}")
    scales = {name + SCALE_SUFFIX for name in quantized}
    dtypes = {name: t.dtype for name, t in tensors.items()
              if name not in quantized and name not in scales and t.dtype.is_floating_point}
    return Mxfp8Output(frozenset(here), dtypes, read_config(folder)[QUANTIZATION_CONFIG], producer, rule,
                       readable(tensors), {name: (folder / name).read_text() for name in files})
