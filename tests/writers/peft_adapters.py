"""Tiny HF base models and PEFT adapter folders written by PEFT itself, plus what PEFT makes of them (the oracle).

    python -m tests.writers.peft_adapters --out DIR

Writes under DIR, for each case: `base/` (save_pretrained, sharded), the adapter folders, and `oracle.pt`
holding PEFT's merge_and_unload state dict, applied adapter by adapter in order, and the logits of the
unmerged PEFT model on a fixed batch. Every adapter uses init_lora_weights=False, so B is not zero.
`wide/` is a base of another hidden size, for the error when an adapter does not fit.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import peft
import torch
import transformers

from tests.writers.tiny_models import build_model, save_hf_folder

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 0, 6, 1]])

# case -> (arch, tied, [(adapter folder, LoraConfig kwargs, save as safetensors)])
CASES = {
    # rsLoRA with rank/alpha patterns, an Embedding adapter and modules_to_save, then a DoRA adapter on top
    "llama": ("llama", False, [
        ("patterns", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj",
                          "embed_tokens"], rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 3},
                          alpha_pattern={"v_proj": 3}, modules_to_save=["model.norm"]), True),
        ("dora", dict(r=2, lora_alpha=5, target_modules=["q_proj", "o_proj", "gate_proj"], use_dora=True), True),
    ]),
    # Conv1D layers (fan_in_fan_out), lora_bias, legacy .bin adapter
    "gpt2": ("gpt2", True, [
        ("conv1d", dict(r=3, lora_alpha=6, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                        lora_bias=True), False),
    ]),
    # tied embeddings, an adapter on lm_head only: the merge must untie them
    "tied": ("llama", True, [
        ("head", dict(r=2, lora_alpha=4, target_modules=["lm_head", "k_proj"]), True),
    ]),
}


def _perturb(model) -> None:
    """DoRA magnitudes start at ||W|| and lora_B biases at 0: move them so a wrong fold cannot pass."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name or ("lora_B" in name and name.endswith("bias")):
                p.add_(torch.randn_like(p) * 0.1)


def write_case(out: Path, case: str) -> None:
    arch, tied, adapters = CASES[case]
    root = out / case
    model = build_model(arch, tied=tied)
    model.save_pretrained(root / "base", max_shard_size="20KB")
    save_hf_folder(model, root / "base")
    oracle = {}
    current = model
    for k, (name, kwargs, safetensors) in enumerate(adapters):
        torch.manual_seed(10 + k)
        wrapped = peft.get_peft_model(current, peft.LoraConfig(init_lora_weights=False, **kwargs))
        _perturb(wrapped)
        wrapped.save_pretrained(root / name, safe_serialization=safetensors)
        with torch.no_grad():
            oracle[f"logits_{k}"] = wrapped(TOKENS).logits
        current = wrapped.merge_and_unload()
        oracle[f"merged_{k}"] = {n: t.detach().clone() for n, t in current.state_dict().items()}
        oracle[f"tied_{k}"] = bool(current.config.tie_word_embeddings)
    torch.save(oracle, root / "oracle.pt")


def write_all(out: Path) -> None:
    transformers.logging.set_verbosity_error()
    for case in CASES:
        write_case(out, case)
    build_model("llama", hidden=48).save_pretrained(out / "wide")  # a base no adapter here fits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    write_all(p.parse_args().out)


if __name__ == "__main__":
    main()
