"""The pure LoRA fold transforms against PEFT's own merge_and_unload on tiny modules (fp32, bit for bit)."""
from __future__ import annotations

import copy

import peft
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from merger.mapping.lora.fold import LoraDelta, fold_module, lora_scale, pattern_value

pytestmark = pytest.mark.slow


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 6)
        self.sq = nn.Linear(8, 8)
        self.conv = Conv1D(6, 8)  # nf=6 outputs, nx=8 inputs: weight stored [in, out]
        self.emb = nn.Embedding(11, 8)
        with torch.no_grad():
            self.conv.bias.normal_()


def _peft(config_kwargs: dict, adapters: int = 1):
    """A PEFT-wrapped Tiny; with several adapters each is merged into the result of the previous one."""
    model = Tiny()
    base = copy.deepcopy(model)
    folded_by_peft, adapter_params = model, []
    for k in range(adapters):
        torch.manual_seed(100 + k)
        config = peft.LoraConfig(init_lora_weights=False, **config_kwargs)
        wrapped = peft.get_peft_model(folded_by_peft, config)
        with torch.no_grad():  # magnitudes start at ||W||: move them so DoRA's factor is not 1
            for name, p in wrapped.named_parameters():
                if "lora_magnitude_vector" in name or "lora_B" in name and name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        adapter_params.append({n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" in n})
        folded_by_peft = wrapped.merge_and_unload()
    return base, folded_by_peft, adapter_params


def _ours(base: nn.Module, adapter_params: list[dict], config_kwargs: dict, module: str,
          fan_in_fan_out: bool, embedding: bool = False) -> list[torch.Tensor]:
    deltas, inputs = [], []
    a_name, b_name = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    suffix = "" if embedding else ".weight"
    for params in adapter_params:
        prefix = f"base_model.model.{module}."
        r = pattern_value(config_kwargs.get("rank_pattern", {}), module, config_kwargs["r"])
        alpha = pattern_value(config_kwargs.get("alpha_pattern", {}), module, config_kwargs["lora_alpha"])
        d = LoraDelta(lora_scale(alpha, r, config_kwargs.get("use_rslora", False)), fan_in_fan_out,
                      bias=config_kwargs.get("lora_bias", False), dora=config_kwargs.get("use_dora", False))
        deltas.append(d)
        inputs += [params[f"{prefix}{a_name}.default{suffix}"], params[f"{prefix}{b_name}.default{suffix}"]]
        if d.bias:
            inputs.append(params[f"{prefix}lora_B.default.bias"])
        if d.dora:
            inputs.append(params[f"{prefix}lora_magnitude_vector.default.weight"])
    layer = getattr(base, module)
    with_bias = any(d.bias for d in deltas)
    head = [layer.weight.detach()] + ([layer.bias.detach()] if with_bias else [])
    return fold_module(tuple(deltas), with_bias)(head + inputs)


CASES = {
    "linear": (dict(r=3, lora_alpha=5, target_modules=["lin", "sq"]), "lin", False, False),
    "rslora": (dict(r=4, lora_alpha=3, use_rslora=True, target_modules=["lin"]), "lin", False, False),
    "conv1d": (dict(r=2, lora_alpha=7, target_modules=["conv"], fan_in_fan_out=True), "conv", True, False),
    "embedding": (dict(r=3, lora_alpha=4, target_modules=["emb"]), "emb", True, True),
    "lora_bias": (dict(r=2, lora_alpha=6, target_modules=["lin"], lora_bias=True), "lin", False, False),
    "dora": (dict(r=2, lora_alpha=6, target_modules=["lin"], use_dora=True), "lin", False, False),
    "dora_conv1d": (dict(r=2, lora_alpha=6, target_modules=["conv"], use_dora=True, fan_in_fan_out=True),
                    "conv", True, False),
    "dora_embedding": (dict(r=2, lora_alpha=6, target_modules=["emb"], use_dora=True), "emb", True, True),
    "patterns": (dict(r=2, lora_alpha=6, target_modules=["lin", "sq"], rank_pattern={"s.": 5, "lin": 3},
                      alpha_pattern={"^sq": 9, "q": 1}), "sq", False, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("adapters", [1, 2])
def test_fold_matches_peft_merge(case, adapters):
    kwargs, module, fan_in_fan_out, embedding = CASES[case]
    base, merged, params = _peft(kwargs, adapters)
    ours = _ours(base, params, kwargs, module, fan_in_fan_out, embedding)
    peft_layer = getattr(merged, module)
    assert torch.equal(ours[0], peft_layer.weight.detach()), case
    if kwargs.get("lora_bias"):
        assert torch.equal(ours[1], peft_layer.bias.detach()), case


def test_pattern_resolution_matches_peft():
    from peft.utils.other import get_pattern_key

    patterns = {"s.": 5, "lin": 3, "layers.1.q": 7, "q": 1}
    for name in ["lin", "sq", "model.layers.1.q", "model.layers.2.q", "a.lin", "xlin", "mlp.down"]:
        want = patterns.get(get_pattern_key(patterns.keys(), name), 2)
        assert pattern_value(patterns, name, 2) == want, name


def test_bf16_base_one_rounding():
    """A bf16 base: PEFT keeps the adapter in fp32 and rounds W + dW once; so does the writer's single cast."""
    kwargs = dict(r=3, lora_alpha=5, target_modules=["lin"])
    model = Tiny().to(torch.bfloat16)
    base = copy.deepcopy(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kwargs))
    params = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" in n}
    assert params["base_model.model.lin.lora_A.default.weight"].dtype == torch.float32
    merged = wrapped.merge_and_unload()
    ours = _ours(base, [params], kwargs, "lin", False)
    assert torch.equal(ours[0].to(torch.bfloat16), merged.lin.weight.detach())
