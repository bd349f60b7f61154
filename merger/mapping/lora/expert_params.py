"""PEFT's LoRA on parameters (`target_parameters`), as PEFT writes it for transformers 5's fused MoE experts
(`mlp.experts.gate_up_proj` and `down_proj`, [experts, ., .]): which base tensors each one changes, and how.

How PEFT (0.21) saves it: one wrapper per targeted parameter of a module; a second parameter of the same module
wraps the first wrapper, so the file names them `<module>.lora_A.weight`, `<module>.base_layer.lora_A.weight`, ...
without saying which parameter each belongs to. Each is matched here to the one parameter of the module, among
those target_parameters names, whose shape it fits (lora_A [E*r, in], lora_B [out, E*r], r from rank_pattern
matched against `<module>.<parameter>`); a LoRA that fits none, or several, is refused. The fold itself is
fold.py's ExpertDelta.

The base holds a parameter either as transformers holds it (gpt-oss saves `<experts>.gate_up_proj` as it is), or
per expert, as save_pretrained writes Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3 and the rest of the Qwen2-MoE family:
transformers' conversion_mapping stacks `<experts>.{e}.gate_proj.weight` and `up_proj` ([I, in] each) into
gate_up_proj[e] (gate's rows first), and `<experts>.{e}.down_proj.weight` into down_proj[e]; each such tensor then
gets its expert's rows of the delta. DeepSeek-V4 stores them as `<experts>.{e}.w1`, `w3` and `w2`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ...catalog import SourceTensor
from ...errors import MergerError
from .fold import ExpertDelta, lora_scale, pattern_value

# The checkpoint's per-expert tensors of a fused parameter, in row order (transformers' conversion_mapping for
# the Qwen2-MoE family: MergeModulelist(dim=0), then Concatenate(dim=1)), in HF's names or in DeepSeek-V4's own
# (w1 the gate, w3 the up projection, w2 down: its conversion stacks w1 before w3; module_names.py).
PER_EXPERT = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
_WRAPPED = re.compile(r"^(.*?)((?:\.base_layer)*)$")
_ROUNDED = (torch.bfloat16, torch.float16)  # PEFT casts the delta to these; float8 and float32 keep it float32


@dataclass
class ParamLora:
    """One LoRA on a parameter as the adapter file holds it: its module, how deep its wrapper is nested, and the
    source names of its lora_A and lora_B."""

    module: str
    depth: int
    a: str = ""
    b: str = ""


@dataclass(frozen=True)
class _Layout:
    """A parameter of shape [experts, out, in] (or [experts, in, out], `transposed`) and where the base holds it:
    (base tensor, its expert or None for the whole parameter, its rows of the expert's [out, in])."""

    param: str
    experts: int
    out_features: int
    in_features: int
    transposed: bool
    pieces: tuple[tuple[str, int | None, tuple[int, int] | None], ...]


def _params_named(module: str, target_parameters) -> list[str]:
    names = []
    for entry in target_parameters:
        param = entry.rpartition(".")[2]
        key = f"{module}.{param}"
        if (key == entry or key.endswith("." + entry)) and param not in names:
            names.append(param)
    return names


def _per_expert(module: str, param: str, current: dict[str, str]) -> tuple[str, ...]:
    """The names of the per-expert tensors the base holds `<module>.<param>` in (none: it holds none per expert)."""
    return next((parts for parts in PER_EXPERT.get(param, ()) if all(f"{module}.0.{p}.weight" in current
                                                                   for p in parts)), ())


def holds_parameter(module: str, target_parameters, current: dict[str, str]) -> bool:
    """Whether the base holds a parameter of `module` that target_parameters names, fused or per expert."""
    return any(f"{module}.{param}" in current or _per_expert(module, param, current)
               for param in _params_named(module, target_parameters))


def wrapped_parameter(module: str, target_parameters) -> tuple[str, int] | None:
    """(module, nesting depth) when a LoRA key's module may be a wrapper of target_parameters, else None. Deeper
    wrappers (`<module>.base_layer`...) are nothing else; an outermost one (`<module>`) may be one when
    target_parameters names a parameter of the module (fold_steps asks the base: holds_parameter)."""
    inner, chain = _WRAPPED.match(module).groups()
    if not target_parameters or not _params_named(inner, target_parameters):
        return None
    return inner, chain.count(".base_layer")


def _layouts(module: str, param: str, current: dict[str, str], tensors: dict[str, SourceTensor],
             transposed: Callable[[str], bool | None], where: str) -> list[_Layout]:
    """The ways the base can hold `<module>.<param>`: none, or one per orientation its shape allows."""
    fused = f"{module}.{param}"
    if fused in current:
        shape = tensors[current[fused]].shape
        if len(shape) == 2:  # E = 1: a plain [out, in] matrix, as PEFT reads a 2-D parameter
            return [_Layout(param, 1, shape[0], shape[1], False, ((fused, None, None),))]
        if len(shape) != 3:
            raise MergerError(f"the adapter has a LoRA on parameter {fused}, which the base holds with shape "
                              f"{shape}; PEFT folds such LoRAs into 2-D or 3-D parameters only, {where}")
        experts, d1, d2 = shape
        orientations = [False, True]
        if d1 == d2:  # square experts: only the model's class says which dim is the input
            answer = transposed(module)
            if answer is None:
                raise MergerError(f"cannot tell whether {fused} {shape} is stored [experts, in, out] or [experts, out, "
                                  f"in]: the installed transformers does not build this model's class to ask its "
                                  f"experts module, {where}")
            orientations = [answer]
        return [_Layout(param, experts, d2 if t else d1, d1 if t else d2, t, ((fused, None, None),))
                for t in orientations]
    parts = _per_expert(module, param, current)
    experts = 0
    while parts and all(f"{module}.{experts}.{p}.weight" in current for p in parts):
        experts += 1
    if not experts:
        return []
    pieces, ins = [], set()
    for e in range(experts):
        start = 0
        for p in parts:
            name = f"{module}.{e}.{p}.weight"
            shape = tensors[current[name]].shape
            if len(shape) != 2:
                return []
            pieces.append((name, e, (start, start + shape[0])))
            ins.add(shape[1])
            start += shape[0]
    if len(ins) != 1:
        return []
    return [_Layout(param, experts, start, ins.pop(), False, tuple(pieces))]


def expert_deltas(params: list[ParamLora], config: dict, current: dict[str, str], tensors: dict[str, SourceTensor],
                  transposed: Callable[[str], bool | None], where: str
                  ) -> list[tuple[str, ExpertDelta, tuple[str, str]]]:
    """(base tensor, its delta, (lora_A, lora_B)) for each base tensor the adapter's LoRAs on parameters change."""
    out = []
    used: set[str] = set()
    for p in sorted(params, key=lambda p: (p.module, -p.depth)):  # innermost first, as PEFT nests them
        a, b = tensors[p.a].shape, tensors[p.b].shape
        fits = []
        for param in _params_named(p.module, config.get("target_parameters") or ()):
            key = f"{p.module}.{param}"
            r = int(pattern_value(config.get("rank_pattern") or {}, key, config["r"]))
            for lay in _layouts(p.module, param, current, tensors, transposed, where):
                if len(a) == 2 and len(b) == 2 and a == (r * lay.experts, lay.in_features) \
                        and b == (lay.out_features, r * lay.experts):
                    fits.append((lay, r))
        shown = f"{p.a.split(':', 1)[-1]} {a} and {p.b.split(':', 1)[-1]} {b}"
        if len(fits) != 1:
            named = ", ".join(_params_named(p.module, config.get("target_parameters") or ()))
            raise MergerError(f"adapter tensors {shown} (a LoRA on a parameter of {p.module}: {named}) fit "
                              f"{'no' if not fits else 'more than one'} parameter the base holds, {where}")
        lay, r = fits[0]
        key = f"{p.module}.{lay.param}"
        if key in used:
            raise MergerError(f"two LoRAs of the adapter fit parameter {key}, {where}")
        used.add(key)
        alpha = float(pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"]))
        scale = lora_scale(alpha, r, bool(config.get("use_rslora")))
        for name, expert, rows in lay.pieces:
            dtype = tensors[current[name]].dtype
            delta = ExpertDelta(scale, lay.experts, lay.transposed, dtype if dtype in _ROUNDED else None,
                                expert, rows)
            out.append((name, delta, (p.a, p.b)))
    return out
