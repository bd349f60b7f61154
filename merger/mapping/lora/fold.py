"""Pure LoRA fold transforms: base weight + adapters -> merged weight, computed the way PEFT merges.

PEFT (0.21) upcasts adapter weights to fp32 on load, computes `transpose(B @ A, fan_in_fan_out) * scale` in
fp32 and adds it to the base weight in place, so a bf16 base gets bf16(fp32(W) + dW): one rounding. Here every
adapter of a module is applied in fp32, in order, and the writer rounds once into the output dtype.

An Embedding adapter is the fan_in_fan_out case of the same rule: its weight is stored [in=vocab, out=dim],
`lora_embedding_A` is [r, vocab], `lora_embedding_B` is [dim, r], and PEFT merges `(B @ A).T * scale`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch


def lora_scale(alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def pattern_value(patterns: dict, module: str, default):
    """rank_pattern / alpha_pattern lookup as PEFT does it: the first key, in dict order, that matches the
    module's full name or a dotted suffix of it; the config's default when none does."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass(frozen=True)
class LoraDelta:
    """One adapter's change to one module. Step inputs per delta: A, B, then B's bias and the DoRA magnitude
    when `bias` / `dora` are set."""

    scale: float
    fan_in_fan_out: bool  # the weight is stored [in, out]: HF Conv1D (GPT-2) and embeddings
    bias: bool = False
    dora: bool = False

    @property
    def n_inputs(self) -> int:
        return 2 + self.bias + self.dora


def _t(x: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return x.T if fan_in_fan_out else x


def delta_weight(a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool) -> torch.Tensor:
    """scale * B @ A in the weight's stored layout, in fp32."""
    return _t(b.float() @ a.float(), fan_in_fan_out) * scale


def fold_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
              fan_in_fan_out: bool) -> torch.Tensor:
    """W + scale * B @ A (transposed for fan_in_fan_out), in fp32."""
    return weight.float() + delta_weight(a, b, scale, fan_in_fan_out)


def fold_dora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor, scale: float,
              fan_in_fan_out: bool) -> torch.Tensor:
    """DoRA: (m / ||W + dW||) * (W + dW), the norm taken per output feature (rows of the [out, in] view)."""
    combined = fold_lora(weight, a, b, scale, fan_in_fan_out)
    norm = torch.linalg.norm(_t(combined, fan_in_fan_out), dim=1)
    factor = magnitude.float() / norm
    return _t(factor.view(-1, 1), fan_in_fan_out) * combined


def fold_bias(bias: torch.Tensor, b_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """lora_bias: the module bias gains lora_B's bias times the scale."""
    return bias.float() + b_bias.float() * scale


@dataclass(frozen=True)
class ExpertDelta:
    """A LoRA on a parameter (PEFT's `target_parameters`), as one base tensor receives it: the whole parameter
    (`expert` None) or, where the base stores experts apart, one expert's rows `rows` of it. Step inputs: A, B.

    The rule (peft 0.21, ParamWrapper.get_delta_weight, written out here): the parameter has `experts` = E
    experts (E = 1 for a 2-D one) and is read as [E, out, in]; lora_A is [E*r, in], expert e owning rows
    e*r .. e*r+r-1; lora_B is [out, r*E], read as [out, r, E], so expert e owns columns e, e+E, e+2E, ...
    delta[e] = scale * B_e @ A_e, an [out, in] matrix per expert, transposed to [in, out] where the module stores
    the parameter [E, in, out] (`transposed`: transformers' `is_transposed` experts, gpt-oss). PEFT casts the
    delta to the parameter's dtype and adds it in place (`round_to`: bf16(W + bf16(delta)) for a bf16 base, each
    adapter on the last one's rounded result); a float8 base's delta stays float32, added to the dequantized
    weight."""

    scale: float
    experts: int
    transposed: bool
    round_to: torch.dtype | None
    expert: int | None = None
    rows: tuple[int, int] | None = None  # of the expert's [out, in] delta; None: all of them
    n_inputs = 2
    bias = False
    dora = False

    def fold(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        e, n, r = self.expert, self.experts, a.shape[0] // self.experts
        if n == 1:  # a 2-D parameter: PEFT takes lora.Linear's B @ A, a plain matrix product
            return self._added(weight, (b.float() @ a.float()) * self.scale)
        if e is None:
            a3 = a.float().reshape(n, r, a.shape[1])  # [E, r, in]
            b3 = b.float().reshape(b.shape[0], r, n).permute(2, 0, 1)  # [E, out, r]
        else:  # one expert's factors only, taken before the float32 copy
            a3, b3 = a[e * r: (e + 1) * r].float()[None], b[:, e::n].float()[None]
        delta = torch.bmm(b3, a3) * self.scale
        if self.rows is not None:
            delta = delta[:, self.rows[0]: self.rows[1]]
        if self.transposed:
            delta = delta.transpose(1, 2)
        return self._added(weight, delta.reshape(weight.shape))

    def _added(self, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.round_to is None:
            return weight.float() + delta
        # PEFT's parameter stays in its dtype: the delta is rounded to it, and so is the sum, adapter by adapter
        return (weight.float() + delta.to(self.round_to).float()).to(self.round_to).float()


def fold_experts(deltas: tuple[tuple[ExpertDelta, ...], ...]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A Step fn for several per-expert tensors that the same LoRAs change: inputs [each tensor, then each LoRA's A
    and B once] -> the tensors, each with its deltas applied in order (fp32; the writer casts them once)."""
    def fn(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        weights, factors = inputs[: len(deltas)], inputs[len(deltas):]
        out = []
        for weight, weight_deltas in zip(weights, deltas):
            for j, d in enumerate(weight_deltas):
                weight = d.fold(weight, factors[2 * j], factors[2 * j + 1])
            out.append(weight)
        return out

    return fn


def fold_module(deltas: tuple[LoraDelta | ExpertDelta, ...], with_bias: bool
                ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A Step fn: inputs [weight, (bias if with_bias), per delta A, B, (B bias), (magnitude)] -> [weight, (bias)].

    Deltas apply in order, each to the result of the previous ones (as merging adapters one after another);
    results stay fp32 and the writer casts them once to the output dtype.
    """
    def fn(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        weight = inputs[0]
        bias = inputs[1] if with_bias else None
        i = 2 if with_bias else 1
        for d in deltas:
            a, b = inputs[i], inputs[i + 1]
            b_bias = inputs[i + 2] if d.bias else None
            magnitude = inputs[i + 2 + d.bias] if d.dora else None
            i += d.n_inputs
            if isinstance(d, ExpertDelta):
                weight = d.fold(weight, a, b)
            elif d.dora:
                weight = fold_dora(weight, a, b, magnitude, d.scale, d.fan_in_fan_out)
            else:
                weight = fold_lora(weight, a, b, d.scale, d.fan_in_fan_out)
            if b_bias is not None:
                bias = fold_bias(bias, b_bias, d.scale)
        return [weight] if bias is None else [weight, bias]

    return fn
