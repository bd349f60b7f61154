"""`merger lora` with PEFT adapters on transformers 5's fused MoE expert tensors (`target_parameters`), against
PEFT itself: every tensor of PEFT's merge_and_unload (saved by save_pretrained), and the logits of the unmerged
PEFT model. Bases as save_pretrained writes them: Qwen3-MoE and Qwen3.5-MoE (text, and the VLM as released) per
expert (`experts.{e}.gate_proj`, ...), gpt-oss fused and transposed ([experts, in, out]) with a square
down_proj, whose layout only the model's class can tell.

The tensors are compared bit for bit: merger computes each expert's delta in float32 as PEFT does (one matmul of
the same factors per expert), casts it to a bfloat16 base's dtype and rounds the sum as PEFT's in-place add does,
so no tolerance is needed. Logits (float32 only) are compared with the unmerged PEFT model's within 1e-5: the
merged and unmerged forwards add the same terms in another order.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from merger.cli import main
from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run_merger
from tests.helpers.weights import load_safetensors_folder

pytestmark = pytest.mark.slow

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4], [4, 4, 8, 0, 6, 1, 2, 10]])
SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8)


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(**SMALL, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                       num_experts_per_tok=2)


def _qwen3_5_moe():
    return transformers.Qwen3_5MoeTextConfig(**SMALL, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                             num_experts=4, num_experts_per_tok=2,
                                             layer_types=["linear_attention", "full_attention"],
                                             linear_num_key_heads=2, linear_num_value_heads=2,
                                             linear_key_head_dim=8, linear_value_head_dim=8)


def _qwen3_5_moe_vlm():
    # the released Qwen3.5-MoE: the text model under model.language_model, beside a vision tower
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    return transformers.Qwen3_5MoeConfig(text_config=_qwen3_5_moe().to_dict(), vision_config=vision)


def _gpt_oss():
    # intermediate_size == hidden_size, as in the released gpt-oss (2880): down_proj [experts, 16, 16] is square
    return transformers.GptOssConfig(**SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"])


def _auto(config: dict):
    return transformers.AutoModelForImageTextToText if "vision_config" in config else transformers.AutoModelForCausalLM


def _base(folder: Path, config, dtype: torch.dtype) -> Path:
    torch.manual_seed(0)
    model = _auto(config.to_dict()).from_config(config)
    with torch.no_grad():  # norms and biases start at 1 and 0: randomise them so a mix-up cannot go unnoticed
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.to(dtype).save_pretrained(folder)
    return folder


def _load(base: Path, dtype: torch.dtype):
    return _auto(json.loads((base / "config.json").read_text())).from_pretrained(base, dtype=dtype).eval()


def _adapter(base: Path, dtype: torch.dtype, folder: Path, **lora) -> torch.Tensor:
    """A PEFT adapter with random A and B (init_lora_weights=False: B is not zero) saved to `folder`; returns the
    logits of the unmerged PEFT model."""
    torch.manual_seed(1)
    model = peft.get_peft_model(_load(base, dtype), peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(TOKENS).logits


def _peft_merged(base: Path, dtype: torch.dtype, adapter: Path, folder: Path) -> dict[str, torch.Tensor]:
    peft.PeftModel.from_pretrained(_load(base, dtype), adapter).merge_and_unload().save_pretrained(folder)
    return load_safetensors_folder(folder)


def _logits(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return _load(folder, dtype)(TOKENS).logits


CASES = {
    # per-expert base; rank and alpha patterns on one fused parameter, rsLoRA, a LoRA on the router's 2-D weight
    # as a parameter, and one on attention beside
    "qwen3_moe": (_qwen3_moe, dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj"],
                                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                      "mlp.gate.weight"],
                                   rank_pattern={"down_proj": 3}, alpha_pattern={"gate_up_proj": 5})),
    # PEFT turns target_modules gate_proj/up_proj/down_proj into target_parameters on the fused experts, rank and
    # alpha doubled on gate_up_proj by a rank_pattern / alpha_pattern it writes itself
    "qwen3_moe_from_modules": (_qwen3_moe, dict(r=2, lora_alpha=3, target_modules=["gate_proj", "up_proj",
                                                                                    "down_proj", "q_proj"])),
    # per-expert base with a shared expert, whose linear down_proj takes an ordinary LoRA although the short
    # target_parameters entry "down_proj" matches its name too
    "qwen3_5_moe": (_qwen3_5_moe, dict(r=2, lora_alpha=3, target_modules=["down_proj", "q_proj"],
                                       target_parameters=["gate_up_proj", "down_proj"])),
    "qwen3_5_moe_vlm": (_qwen3_5_moe_vlm, dict(r=2, lora_alpha=3, target_modules=["q_proj"],
                                               target_parameters=["mlp.experts.gate_up_proj",
                                                                  "mlp.experts.down_proj"])),
    # fused, [experts, in, out] base (transformers' is_transposed), square down_proj
    "gpt_oss": (_gpt_oss, dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_on_fused_experts_equals_peft_merge(case, dtype, tmp_path):
    make_config, lora = CASES[case]
    base = _base(tmp_path / "base", make_config(), dtype)
    peft_logits = _adapter(base, dtype, tmp_path / "adapter", **lora)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] and config["init_lora_weights"] is False
    want = _peft_merged(base, dtype, tmp_path / "adapter", tmp_path / "peft")

    assert main(["lora", "--base_model", str(base), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "out")]) == 0
    got, stored = load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(base)
    assert sorted(got) == sorted(want)
    experts = [n for n in want if ".experts." in n and not n.endswith("bias")]
    assert experts and all(not torch.equal(want[n], stored[n]) for n in experts)  # every expert tensor changed
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    if dtype == torch.float32:  # bf16 logits of two routings can differ by a rounding-flipped expert choice
        torch.testing.assert_close(_logits(tmp_path / "out", dtype), peft_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step_bytes", [1, 3 * 4 * 8 * 16], ids=["one_tensor_a_step", "three_tensors_a_step"])
def test_per_expert_tensors_fold_the_same_in_smaller_steps(step_bytes, tmp_path, monkeypatch):
    """Per-expert tensors share steps up to a size (each step reads every expert's A and B once); cut smaller, in
    steps of one tensor or of three (an expert's gate_proj in one step, its up_proj in the next), the bytes are the
    same: PEFT's merge."""
    from merger.mapping.lora import fold_steps

    monkeypatch.setattr(fold_steps, "EXPERT_STEP_BYTES", step_bytes)
    make_config, lora = CASES["qwen3_moe"]
    base = _base(tmp_path / "base", make_config(), torch.bfloat16)
    _adapter(base, torch.bfloat16, tmp_path / "adapter", **lora)
    want = _peft_merged(base, torch.bfloat16, tmp_path / "adapter", tmp_path / "peft")
    assert main(["lora", "--base_model", str(base), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "out")]) == 0
    got = load_safetensors_folder(tmp_path / "out")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_two_adapters_on_experts_equal_peft_merging_one_after_another(case, tmp_path):
    """`--adapter` twice on a bfloat16 base: PEFT merges the first, then the second into the merged model, its
    parameter rounded to bfloat16 after each."""
    make_config, lora = CASES[case]
    base = _base(tmp_path / "base", make_config(), torch.bfloat16)
    _adapter(base, torch.bfloat16, tmp_path / "first", **lora)
    torch.manual_seed(2)
    second = peft.get_peft_model(_load(base, torch.bfloat16), peft.LoraConfig(
        r=3, lora_alpha=2, init_lora_weights=False, target_modules=[], target_parameters=lora.get(
            "target_parameters", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])))
    second.save_pretrained(tmp_path / "second")
    merged = peft.PeftModel.from_pretrained(_load(base, torch.bfloat16), tmp_path / "first").merge_and_unload()
    peft.PeftModel.from_pretrained(merged, tmp_path / "second").merge_and_unload().save_pretrained(tmp_path / "peft")
    want = load_safetensors_folder(tmp_path / "peft")

    assert main(["lora", "--base_model", str(base), "--adapter", str(tmp_path / "first"), "--adapter",
                 str(tmp_path / "second"), "--target_dir", str(tmp_path / "out")]) == 0
    got = load_safetensors_folder(tmp_path / "out")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_lora_on_fused_experts_on_two_ranks(tmp_path):
    """Two ranks write the bytes one process writes."""
    make_config, lora = CASES["gpt_oss"]
    base = _base(tmp_path / "base", make_config(), torch.bfloat16)
    _adapter(base, torch.bfloat16, tmp_path / "adapter", **lora)
    for out, nproc in (("one", 1), ("two", 2)):
        run_merger("lora", "--base_model", base, "--adapter", tmp_path / "adapter", "--target_dir", tmp_path / out,
                   "--max_shard_size", "20KB", nproc=nproc)
    one, two = load_safetensors_folder(tmp_path / "one"), load_safetensors_folder(tmp_path / "two")
    assert sorted(one) == sorted(two) and all(torch.equal(one[n], two[n]) for n in one)


def test_lora_on_experts_that_do_not_fit_is_refused(tmp_path, capsys):
    """An adapter whose expert LoRAs fit no parameter of the base, a square experts tensor whose layout the
    installed transformers cannot tell (a model class it lacks), and nested LoRAs on parameters that the adapter
    config does not name: one line each, nothing written."""
    qwen = _base(tmp_path / "qwen", _qwen3_moe(), torch.float32)
    gpt = _base(tmp_path / "gpt", _gpt_oss(), torch.float32)
    _adapter(qwen, torch.float32, tmp_path / "qwen_adapter", r=2, lora_alpha=4, target_modules=[],
             target_parameters=["mlp.experts.down_proj"])
    assert main(["lora", "--base_model", str(gpt), "--adapter", str(tmp_path / "qwen_adapter"), "--target_dir",
                 str(tmp_path / "a")]) == 1
    error = single_error_line(capsys.readouterr().err)
    assert error.startswith("merger: error: adapter tensors base_model.model.model.layers.0.mlp.experts.lora_A."
                            "weight (8, 8) and base_model.model.model.layers.0.mlp.experts.lora_B.weight (16, 8) "
                            "(a LoRA on a parameter of model.layers.0.mlp.experts: down_proj) fit no parameter the "
                            "base holds, "), error
    assert error.endswith(str(tmp_path / "qwen_adapter")), error

    _adapter(gpt, torch.float32, tmp_path / "gpt_adapter", r=2, lora_alpha=4, target_modules=[],
             target_parameters=["mlp.experts.down_proj"])
    unknown = tmp_path / "unknown"
    shutil.copytree(gpt, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(dict(config, architectures=["GptOssNotInTransformers"])))
    assert main(["lora", "--base_model", str(unknown), "--adapter", str(tmp_path / "gpt_adapter"), "--target_dir",
                 str(tmp_path / "b")]) == 1
    assert single_error_line(capsys.readouterr().err) == (
        "merger: error: cannot tell whether model.layers.0.mlp.experts.down_proj (4, 16, 16) is stored [experts, "
        "in, out] or [experts, out, in]: the installed transformers does not build this model's class to ask its "
        f"experts module, {tmp_path / 'gpt_adapter'}")

    # a config that lost its target_parameters: the nested LoRA names no module of the base
    both = tmp_path / "both"
    _adapter(gpt, torch.float32, both, r=2, lora_alpha=4, target_modules=[],
             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    config = json.loads((both / "adapter_config.json").read_text())
    (both / "adapter_config.json").write_text(json.dumps(dict(config, target_parameters=None)))
    assert main(["lora", "--base_model", str(gpt), "--adapter", str(both), "--target_dir", str(tmp_path / "c")]) == 1
    assert single_error_line(capsys.readouterr().err) == (
        "merger: error: tensor model.layers.0.mlp.experts.base_layer.lora_A.weight is a LoRA on a parameter of "
        f"model.layers.0.mlp.experts, which the adapter config's target_parameters does not name, {both}")
    assert not any((tmp_path / out).exists() for out in "abc")
