"""Steps that write a base model with LoRA adapters folded in: one fold Step per adapted module, a copy per
other tensor, modules_to_save as replacements, and tied embeddings untied when an adapter changes one side.

Inputs are names: `base` maps each HF output name to the source tensor holding the base value, and each
adapter's parts are source tensor names too, so the same rules serve a HF folder plus adapter folders and
the state dict of a PEFT-wrapped model in an FSDP checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ...catalog import SourceTensor
from ...errors import MergerError
from ..policy import TIED_OUTPUT, input_embedding
from ..steps import OutputSpec, Step
from .adapter import LoraAdapter, ModuleAdapter, resolve_module
from .expert_params import ParamLora, expert_deltas, holds_parameter
from .fold import ExpertDelta, LoraDelta, fold_experts, fold_module

# Per-expert tensors that the same LoRAs change share a step, up to this many bytes of float32 results: a step
# reads the LoRAs' factors (every expert's A and B) once, not once per expert tensor (3 x 128 times a layer).
EXPERT_STEP_BYTES = 128 << 20


@dataclass
class FoldResult:
    steps: list[Step]
    untied: bool  # config.json must then say tie_word_embeddings: false


def _shown(source: str) -> str:
    """A source tensor as the user's file names it: without the `adapter{k}:` prefix of a merged catalog."""
    return source.split(":", 1)[-1]


def _delta(m: ModuleAdapter, adapter: LoraAdapter, weight: str, shape: tuple, tensors: dict[str, SourceTensor]
           ) -> tuple[LoraDelta, tuple[str, ...]]:
    a, b = tensors[m.a].shape, tensors[m.b].shape
    straight, transposed = (b[0], a[1]), (a[1], b[0])
    if len(a) != 2 or len(b) != 2 or a[0] != b[1] or shape not in (straight, transposed):
        raise MergerError(f"adapter tensors {_shown(m.a)} {a} and {_shown(m.b)} {b} do not fit base tensor "
                          f"{weight} {shape}, {adapter.name}")
    if m.embedding:
        fan_in_fan_out = True
    elif straight != transposed:
        fan_in_fan_out = shape == transposed
    else:  # square: only the config can tell a Conv1D from a Linear
        fan_in_fan_out = bool(adapter.config.get("fan_in_fan_out"))
    if m.embedding and shape != transposed:
        raise MergerError(f"embedding adapter {_shown(m.a)} {a} does not fit base tensor {weight} {shape}, "
                          f"{adapter.name}")
    out = b[0]
    for extra in (m.b_bias, m.magnitude):
        if extra is not None and tensors[extra].shape != (out,):
            raise MergerError(f"adapter tensor {_shown(extra)} is {tensors[extra].shape}, base module needs "
                              f"({out},), {adapter.name}")
    names = (m.a, m.b) + ((m.b_bias,) if m.b_bias else ()) + ((m.magnitude,) if m.magnitude else ())
    return LoraDelta(m.scale, fan_in_fan_out, bias=m.b_bias is not None, dora=m.magnitude is not None), names


def _split_params(adapter: LoraAdapter, current: dict[str, str], tensors: dict[str, SourceTensor]
                  ) -> tuple[dict[str, ModuleAdapter], list[ParamLora]]:
    """The adapter's modules and its LoRAs on parameters; an outermost one on a module that holds none of the
    parameters target_parameters names (a linear layer whose name a short entry also matches, "down_proj") is one
    of the modules."""
    modules, params = dict(adapter.modules), []
    for p in adapter.params.values():
        if p.depth == 0 and not holds_parameter(p.module, adapter.config["target_parameters"], current):
            m = modules[p.module] = ModuleAdapter(p.module, p.a, p.b)
            resolve_module(m, adapter.config, {n: tensors[n].shape for n in (p.a, p.b)}, adapter.name)
        else:
            params.append(p)
    return modules, params


def _expert_groups(deltas: dict[str, list], shapes: dict[str, tuple]) -> list[list[str]]:
    """The per-expert tensors (their deltas all ExpertDeltas of one expert) in groups that share the same LoRA
    inputs, each group at most EXPERT_STEP_BYTES of float32 (one tensor at least)."""
    groups: dict[tuple[str, ...], list[tuple[list[str], int]]] = {}
    for weight, weight_deltas in deltas.items():
        if not all(isinstance(d, ExpertDelta) and d.expert is not None for d, _ in weight_deltas):
            continue
        size = 4 * math.prod(shapes[weight])
        chunks = groups.setdefault(tuple(n for _, names in weight_deltas for n in names), [([], 0)])
        if chunks[-1][0] and chunks[-1][1] + size > EXPERT_STEP_BYTES:
            chunks.append(([], 0))
        chunks[-1] = (chunks[-1][0] + [weight], chunks[-1][1] + size)
    return [names for chunks in groups.values() for names, _ in chunks]


def fold_steps(base: dict[str, str], adapters: list[LoraAdapter], tensors: dict[str, SourceTensor], tied: bool,
               experts_transposed: Callable[[str], bool | None] = lambda module: None) -> FoldResult:
    """Apply `adapters` in order to the base of a model that ties its embeddings or not. Each output is declared
    in its base tensor's dtype, whatever dtype the adapter stored; a tied lm_head is written only when an
    adapter unties it (the policy leaves it out otherwise). `experts_transposed(module)` says whether an experts
    module stores its square tensors [experts, in, out] (None: unknown), for LoRAs on parameters."""
    embedding = input_embedding(base) if tied else None
    origin = dict(base)  # output name -> the base tensor it starts from
    if tied and TIED_OUTPUT not in origin and embedding is not None:
        origin[TIED_OUTPUT] = base[embedding]  # written only if an adapter unties it
    current = dict(origin)  # output name -> the tensor holding its value after replacements
    deltas: dict[str, list[tuple[LoraDelta | ExpertDelta, tuple[str, ...]]]] = {}  # base weight -> its deltas
    changed: set[str] = set()
    for adapter in adapters:
        for target, source in adapter.replacements.items():
            if target not in current:
                raise MergerError(f"adapter replaces {target}, which the base model lacks, {adapter.name}")
            if tensors[source].shape != tensors[current[target]].shape:
                raise MergerError(f"adapter tensor {_shown(source)} is {tensors[source].shape} but base tensor "
                                  f"{target} is {tensors[current[target]].shape}, {adapter.name}")
            current[target] = source
            changed.add(target)
            deltas.pop(target, None)  # a later replacement wins over earlier folds
        modules, params = _split_params(adapter, current, tensors)
        for module, m in modules.items():
            weight = module + ".weight"
            if weight not in current:
                raise MergerError(f"adapter module {module} ({_shown(m.a)}) has no base tensor {weight}, "
                                  f"{adapter.name}")
            if m.b_bias and module + ".bias" not in current:
                raise MergerError(f"adapter has lora_B bias {_shown(m.b_bias)} but base module {module} has no "
                                  f"bias, {adapter.name}")
            deltas.setdefault(weight, []).append(_delta(m, adapter, weight, tensors[current[weight]].shape, tensors))
            changed.update({weight} | ({module + ".bias"} if m.b_bias else set()))
        for weight, delta, names in expert_deltas(params, adapter.config, current, tensors, experts_transposed,
                                                  adapter.name):
            deltas.setdefault(weight, []).append((delta, names))
            changed.add(weight)

    untied = tied and bool(changed & {TIED_OUTPUT, embedding})

    def spec(name: str, shape: tuple) -> OutputSpec:
        return OutputSpec(name, shape, tensors[origin[name]].dtype)

    steps, folded_biases = [], set()
    grouped = _expert_groups(deltas, {w: tensors[current[w]].shape for w in deltas})
    for group in grouped:
        factors = tuple(n for _, names in deltas[group[0]] for n in names)
        steps.append(Step(tuple(current[w] for w in group) + factors,
                          tuple(spec(w, tensors[current[w]].shape) for w in group),
                          fold_experts(tuple(tuple(d for d, _ in deltas[w]) for w in group))))
    in_groups = {w for group in grouped for w in group}
    for weight, module_deltas in deltas.items():
        if weight in in_groups:
            continue
        bias = weight.removesuffix(".weight") + ".bias"
        with_bias = any(d.bias for d, _ in module_deltas)
        inputs = (current[weight],) + ((current[bias],) if with_bias else ())
        inputs += tuple(n for _, names in module_deltas for n in names)
        outputs = (spec(weight, tensors[current[weight]].shape),)
        if with_bias:
            outputs += (spec(bias, tensors[current[bias]].shape),)
            folded_biases.add(bias)
        steps.append(Step(inputs, outputs, fold_module(tuple(d for d, _ in module_deltas), with_bias)))
    for name, source in current.items():
        if name in deltas or name in folded_biases:
            continue
        steps.append(Step((source,), (spec(name, tensors[source].shape),)))
    return FoldResult(steps, untied)
