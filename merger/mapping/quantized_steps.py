"""A mapping's steps with their quantized outputs written as a layout says: FP8 block-scaled (fp8_quantize.py) or
gpt-oss's MXFP4 experts (mxfp4_quantize.py).

A layout names the outputs it quantizes (`quantizes`), what each becomes in the files (`written_as`: FP8's weight
and its `_scale_inv`, MXFP4's `_blocks` and `_scales`), the arithmetic (`quantize`), and the dtypes a release
gives the other tensors. `quantize` is handed the output's spec too: its name and slab say which of the
release's bytes an unchanged block keeps (release_blocks.py). A step with a quantized output becomes a transform,
so the output is quantized whole at its writer (its pieces assembled there within the batch budget like any
transform's): a block's scale never spans ranks, and any number of merge ranks writes the same bytes.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Protocol

import torch

from .quantized_check import check
from .steps import OutputSpec, Step, Transform


class QuantizedLayout(Protocol):
    dtypes: dict[str, torch.dtype]
    quantization_config: dict

    def quantizes(self, spec: OutputSpec) -> bool: ...

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]: ...

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]: ...

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]: ...


def _run(transform: Transform | None, quantize_from: tuple[OutputSpec | None, ...], layout: QuantizedLayout,
         checked_as: str | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The step's own results, each quantized output quantized from its tensor in its spec's dtype (the dtype the
    policy gave it: what transformers' quantizer is handed, a model loaded at --dtype); with `checked_as` (the
    format's name, under --verify), each read back and checked against that tensor (quantized_check.py)."""
    results = tensors if transform is None else transform(tensors)
    out = []
    for tensor, spec in zip(results, quantize_from):
        if spec is None:
            out.append(tensor)
            continue
        weight = tensor.to(spec.dtype)
        parts = layout.quantize(weight, spec)
        if checked_as is not None:
            check(spec.name, checked_as, weight, *layout.read_back(parts, spec))
        out.extend(parts)
    return out


def quantize_steps(steps: list[Step], layout: QuantizedLayout, checked_as: str | None = None) -> list[Step]:
    """`steps` with each output `layout` quantizes written as it says, and each other output in the dtype `layout`
    gives it, where it gives one; with `checked_as`, each quantized output checked as it is read back (_run)."""
    out = []
    for step in steps:
        specs, quantize_from = [], []
        for spec in step.outputs:
            if layout.quantizes(spec):
                specs += layout.written_as(spec)
                quantize_from.append(spec)
            else:
                keep = layout.dtypes.get(spec.name) if spec.file is None and spec.dtype.is_floating_point else None
                specs.append(spec if keep is None else dataclasses.replace(spec, dtype=keep))
                quantize_from.append(None)
        if any(q is not None for q in quantize_from):
            step = Step(step.inputs, tuple(specs), partial(_run, step.transform, tuple(quantize_from), layout,
                                                           checked_as))
        else:
            step = dataclasses.replace(step, outputs=tuple(specs))
        out.append(step)
    return out


def quantized_count(steps: list[Step], layout: QuantizedLayout) -> int:
    return len({spec.name for step in steps for spec in step.outputs if layout.quantizes(spec)})  # slabs once
