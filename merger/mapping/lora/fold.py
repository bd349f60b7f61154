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


def fold_module(deltas: tuple[LoraDelta, ...], with_bias: bool) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
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
            if d.dora:
                weight = fold_dora(weight, a, b, magnitude, d.scale, d.fan_in_fan_out)
            else:
                weight = fold_lora(weight, a, b, d.scale, d.fan_in_fan_out)
            if b_bias is not None:
                bias = fold_bias(bias, b_bias, d.scale)
        return [weight] if bias is None else [weight, bias]

    return fn
