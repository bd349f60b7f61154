"""A PEFT LoRA folded into a DeepSeek-V4 release (FP8 ue8m0 in 128x128 blocks, FP4 routed experts in blocks of 1x32)
by `merger lora --base_model RELEASE` and by an adapter-only checkpoint given `--base_model` (#49 item 5). The
release is the session's (tests/writers/deepseek_v4_release.py: transformers' own `deepseek_v4`, saved under the
checkpoint's names, which mix HF's and DeepSeek's: `attn.wq_a`, `ffn.experts.{e}.w1`); the adapter is PEFT's on
transformers' model, under its module names (`self_attn.q_a_proj`, and `mlp.experts.gate_up_proj` / `down_proj` as
target_parameters).

Oracles, none of them merger's code:
- PEFT's `merge_and_unload` of the adapter into the release as transformers' loader dequantizes it (`Fp8Dequantize`,
  FP4 pairs through `_unpack_fp4`) in float32, saved by save_pretrained under the checkpoint's names;
- that merge quantized by transformers' `Fp8Quantize` (ue8m0, 128x128) for each FP8 weight the adapter changed, and
  by DeepSeek's own FP4 rule (tests/helpers/deepseek_v4_quantizers.py) for each expert it changed;
- the release's own bytes for every other tensor, among them layer 1's experts, which DeepSeek's rule on their values
  would write otherwise.
"""
from __future__ import annotations

import json

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers

from merger.cli import main
from tests.helpers.deepseek_v4_quantizers import deepseek_fp4, fp8_quantized
from tests.helpers.release_bytes import bits
from tests.helpers.weights import load_safetensors_folder
from tests.writers.deepseek_v4_release import QUANTIZATION_CONFIG, SCALE

pytestmark = pytest.mark.slow

TARGETS = ["q_a_proj", "o_b_proj", "shared_experts.gate_proj"]  # wq_a, wo_b and shared_experts.w1 in the release
EXPERTS = ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"]  # layer 0's w1, w3 and w2


def _dequantized(release):
    return transformers.AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32)


def _adapted(name: str) -> bool:
    return name.split(".")[-2] in ("wq_a", "wo_b") or ".shared_experts.w1." in name or ".layers.0.ffn.experts." in name


def test_lora_folded_into_a_deepseek_v4_release_is_peft_merge_then_fp8_and_deepseek_s_fp4_rules(deepseek_v4,
                                                                                                 tmp_path, capsys):
    release, _ = deepseek_v4
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=TARGETS, target_parameters=EXPERTS,
                             init_lora_weights=False)
    peft.get_peft_model(_dequantized(release), config).save_pretrained(tmp_path / "adapter")
    peft.PeftModel.from_pretrained(_dequantized(release), tmp_path / "adapter").merge_and_unload().save_pretrained(
        tmp_path / "peft-merged")
    want, stored = load_safetensors_folder(tmp_path / "peft-merged"), load_safetensors_folder(release)

    assert main(["lora", "--base_model", str(release), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "keep")]) == 0
    got = load_safetensors_folder(tmp_path / "keep")
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in stored.items()}
    adapted = [n for n in stored if n + SCALE in stored and _adapted(n)]
    assert sum(stored[n].dtype == torch.int8 for n in adapted) == 12 and len(adapted) == 18
    for name in adapted:
        codes, scale = deepseek_fp4(want[name]) if stored[name].dtype == torch.int8 else fp8_quantized(name, want[name])
        assert torch.equal(bits(got[name]), bits(codes)) and torch.equal(bits(got[name + SCALE]), scale), name
        assert not torch.equal(bits(got[name]), bits(stored[name])), name
    for name in set(stored) - {n + part for n in adapted for part in ("", SCALE)}:
        assert torch.equal(bits(got[name]), bits(stored[name])), name
    untouched = [n for n in stored if ".layers.1.ffn.experts." in n and not n.endswith(SCALE)]
    assert any(not torch.equal(deepseek_fp4(want[n])[1], bits(stored[n + SCALE])) for n in untouched)  # the premise
    assert json.loads((tmp_path / "keep" / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG

    # --dtype bfloat16: PEFT's merge as a plain model, one rounding (what transformers keeps in float32 stays so)
    assert main(["lora", "--base_model", str(release), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    plain = load_safetensors_folder(tmp_path / "bf16")
    assert sorted(plain) == sorted(want) and all(plain[n].dtype == torch.bfloat16 for n in adapted)
    for name, t in want.items():
        assert torch.equal(bits(plain[name]), bits(t.to(plain[name].dtype))), name
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())

    # the same adapter saved as accelerate saves an adapter-only FSDP checkpoint (dcp.save of PEFT's state dict under
    # "model", no adapter config), given the release as its base: the same model
    dcp.save({"model": load_safetensors_folder(tmp_path / "adapter")},
             checkpoint_id=tmp_path / "checkpoint-1" / "pytorch_model_fsdp_0", no_dist=True)
    assert main(["merge", "--local_dir", str(tmp_path / "checkpoint-1"), "--base_model", str(release),
                 "--adapter_config", str(tmp_path / "adapter"), "--dtype", "keep", "--target_dir",
                 str(tmp_path / "adapter-only")]) == 0
    again = load_safetensors_folder(tmp_path / "adapter-only")
    assert sorted(again) == sorted(got) and all(torch.equal(bits(again[n]), bits(t)) for n, t in got.items())
    capsys.readouterr()
