"""A mapping's steps with their quantized outputs written as a layout says: FP8 block-scaled (fp8_quantize.py) or
gpt-oss's MXFP4 experts (mxfp4_quantize.py).

A layout names the outputs it quantizes (`quantizes`), what each becomes in the files (`written_as`: FP8's weight
and its `_scale_inv`, MXFP4's `_blocks` and `_scales`), the arithmetic (`quantize`), and the dtypes a release
gives the other tensors. `quantize` is handed the output's spec too: its name and slab say which of the
release's bytes an unchanged block keeps (release_blocks.py). A step with a quantized output becomes a transform,
so the output is quantized whole at its writer (its pieces assembled there within the batch budget like any
transform's): a block's scale never spans ranks, and any number of merge ranks writes the same bytes.

A scale shared across tensors (NVFP4's global scale, shared by the layers vLLM fuses: q/k/v, gate/up) is the one
exception: a layout with such sets names them (`shared`), the steps writing a set's members become one step, and
the layout quantizes the set together (`quantize_together`), so the scale is computed from all of them at one
writer.
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
    weights = {spec.name: tensor.to(spec.dtype) for tensor, spec in zip(results, quantize_from) if spec is not None}
    specs = {spec.name: spec for spec in quantize_from if spec is not None}
    if _shared(layout):  # the step writes a set of weights that share a scale (or one weight): quantized together
        quantized = layout.quantize_together(weights)
    else:
        quantized = {name: layout.quantize(weight, specs[name]) for name, weight in weights.items()}
    out = []
    for tensor, spec in zip(results, quantize_from):
        if spec is None:
            out.append(tensor)
            continue
        parts = quantized[spec.name]
        if checked_as is not None:
            check(spec.name, checked_as, weights[spec.name], *layout.read_back(parts, spec))
        out.extend(parts)
    return out


def _shared(layout: QuantizedLayout) -> list[frozenset[str]] | None:
    """The sets of outputs whose quantization shares a scale across tensors (NVFP4's global scale), for a layout
    that has such sets (its `shared`; it then quantizes with `quantize_together`), else None."""
    return getattr(layout, "shared", None)


def _run_joined(steps: tuple[Step, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The results of `steps`, one after another, from their inputs one after another."""
    out, at = [], 0
    for step in steps:
        out += step.run(tensors[at:at + len(step.inputs)])
        at += len(step.inputs)
    return out


def join_shared(steps: list[Step], shared: list[frozenset[str]]) -> list[Step]:
    """`steps` with the steps writing the members of each set of `shared` made one, at the first one's place: a
    scale shared across tensors is computed where all of them are (the writer assembles the joined step's inputs as
    any transform's), so that no member is quantized with another's scale, on any number of ranks."""
    index = {name: i for i, members in enumerate(shared) for name in members}
    first: dict[int, int] = {}  # a set -> the first step writing one of its members
    parent = list(range(len(steps)))

    def root(n: int) -> int:
        while parent[n] != n:
            n = parent[n]
        return n

    for n, step in enumerate(steps):
        for spec in step.outputs:
            member = index.get(spec.name) if spec.rows is None and spec.file is None else None
            if member is None:
                continue
            lo, hi = sorted((root(n), root(first.setdefault(member, n))))
            parent[hi] = lo  # a step writing members of two sets (a fused qkv and gate_up) joins both
    joined: dict[int, list[Step]] = {}
    for n, step in enumerate(steps):
        joined.setdefault(root(n), []).append(step)
    return [group[0] if len(group) == 1 else
            Step(tuple(i for s in group for i in s.inputs), tuple(o for s in group for o in s.outputs),
                 partial(_run_joined, tuple(group)))
            for _, group in sorted(joined.items())]


def quantize_steps(steps: list[Step], layout: QuantizedLayout, checked_as: str | None = None) -> list[Step]:
    """`steps` with each output `layout` quantizes written as it says, and each other output in the dtype `layout`
    gives it, where it gives one; with `checked_as`, each quantized output checked as it is read back (_run)."""
    out = []
    shared = _shared(layout)
    for step in (steps if not shared else join_shared(steps, shared)):
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
