"""`--quantize nvfp4` and `--quantize int4`: a model with no release written in compressed-tensors'
`nvfp4-pack-quantized` (llmcompressor's NVFP4A16) and INT4 `pack-quantized` (Kimi-K2's routed experts in groups of
32), byte-equal to compressed-tensors' own quantization of the same bfloat16 model (#49 items 4 and 6).

Oracles, none of them merger's code:
- compressed-tensors 0.20 itself (tests/writers/compressed_tensors_release.py): its `apply_quantization_config`,
  `generate_gparam`, `compute_dynamic_scales_and_zp` and `ModelCompressor`, on the transformers Llama as
  llmcompressor's oneshot saves it (the global scale shared as oneshot shares it: the smallest of q/k/v's, of
  gate/up's), and on a tiny DeepSeek-V3 checkpoint an nn.Linear per weight as model_free_ptq quantizes one, with
  oneshot's sets (llmcompressor 0.14's FUSED_LAYER_NAMES); the quantization_config its `update_config` writes,
  whose `ignore` it lists itself (every Linear left unquantized);
- compressed-tensors' dequantizer (`CompressedTensorsDequantizer`) and transformers' own loader, which FORMATS.md
  found reads INT4 experts and NVFP4's dense layers right, read the output back alike.
The test's own rule says which layers are quantized: every 2-dim weight of a Linear layer but lm_head (int4: the
routed experts) whose last dim is whole groups (an experts module: all of its weights).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tests.helpers.in_process import merge_here, merge_in_process, stdout_in_process
from tests.helpers.processes import run_merger
from tests.helpers.release_bytes import same_bytes
from tests.helpers.weights import load_safetensors_folder
from tests.writers.compressed_tensors_release import SHARED, TINY, compress_checkpoint, write_release
from tests.writers.fp8_release import DEEPSEEK

NVFP4, INT4 = "nvfp4-pack-quantized", "pack-quantized"
# llmcompressor 0.14's oneshot: the sibling layers that share NVFP4's global scale
ONESHOT = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
           ("w1", "w3"))
# hidden 64 and experts 64 wide: whole groups of 16 and 32; q_b_proj (q_lora_rank 20) and kv_b_proj
# (kv_lora_rank 12) are not whole groups of 16
DEEPSEEK_64 = dict(DEEPSEEK, hidden_size=64, intermediate_size=64, moe_intermediate_size=64)


def _save(model: transformers.PreTrainedModel, folder):
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny bfloat16 DeepSeek-V3 (a dense layer, a MoE layer of 4 routed experts and a shared one) as
    save_pretrained writes it: one weight per expert."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_64))
    return _save(model, tmp_path_factory.mktemp("ct_quantize") / "deepseek")


def _linear(weights: dict) -> list[str]:
    """The checkpoint's Linear layers' weights: every 2-dim one but the embeddings and DeepSeek's router."""
    return sorted(n for n, t in weights.items() if t.dim() == 2 and "embed_tokens" not in n
                  and not n.endswith("mlp.gate.weight"))


def _assert_is(got: dict, want: dict) -> None:
    """`got` holds `want`'s tensors, every byte; a tensor transformers keeps in float32 (DeepSeek's router),
    written so by merger's dtype policy, holds its values."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        if got[name].dtype == torch.float32 and t.dtype == torch.bfloat16:
            assert torch.equal(got[name].to(t.dtype), t), name
        else:
            assert same_bytes(got[name], t), name


def _quantization_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def _read_back(folder) -> tuple[dict, dict]:
    """(compressed-tensors' dequantizer's bfloat16 weights of `folder`, transformers' loaded model's state dict)."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    values = CompressedTensorsDequantizer(folder, dtype=torch.bfloat16).process(load_safetensors_folder(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    return values, model.state_dict()


def test_nvfp4_is_what_compressed_tensors_writes_as_oneshot_saves_it(tmp_path):
    """The tiny Llama: every byte and the quantization_config are compressed-tensors' (global scales shared across
    q/k/v and gate/up), and transformers loads the dense layers as compressed-tensors' dequantizer reads them."""
    torch.manual_seed(0)
    plain = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)), tmp_path / "plain")
    out = merge_in_process(plain, tmp_path / "out", "--quantize", "nvfp4")
    want = write_release(tmp_path / "want", NVFP4, weights=load_safetensors_folder(plain), shared=SHARED["oneshot"])
    got = load_safetensors_folder(out)
    _assert_is(got, load_safetensors_folder(want))
    assert sum(n.endswith(".weight_packed") for n in got) == 14
    assert _quantization_config(out) == _quantization_config(want)
    values, loaded = _read_back(out)
    assert sorted(values) == sorted(loaded)
    assert all(torch.equal(loaded[n], values[n]) for n in values)


def test_nvfp4_of_a_moe_is_compressed_tensors_and_names_what_is_not_whole_groups(deepseek, tmp_path, capsys):
    """The tiny DeepSeek-V3: each expert's gate/up share a global scale, as do q_a_proj and kv_a_proj_with_mqa;
    q_b_proj and kv_b_proj (20 and 12 wide) stay bfloat16, in `ignore`, named by the log and `inspect`; 2 merge
    ranks write the bytes of one."""
    weights = load_safetensors_folder(deepseek)
    linear = _linear(weights)
    left = [n for n in linear if n == "lm_head.weight" or weights[n].shape[-1] % 16]
    assert len(left) == 5  # lm_head, q_b_proj and kv_b_proj of both layers
    want, config = compress_checkpoint(tmp_path / "want", weights, NVFP4, linear,
                                       [n.removesuffix(".weight") for n in left], ONESHOT)
    out = merge_in_process(deepseek, tmp_path / "out", "--quantize", "nvfp4", "--verify")
    got = load_safetensors_folder(out)
    _assert_is(got, want)
    expert = "model.layers.1.mlp.experts.2."
    assert same_bytes(got[expert + "gate_proj.weight_global_scale"], got[expert + "up_proj.weight_global_scale"])
    assert _quantization_config(out) == config
    # 2 merge ranks, each batch a few tensors: the layers sharing a global scale are quantized at one rank
    run_merger("merge", "--local_dir", deepseek, "--target_dir", tmp_path / "two", "--quantize", "nvfp4",
               "--max_inflight", "4KiB", nproc=2)
    assert (tmp_path / "two" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", deepseek, "--quantize", "nvfp4",
                                         "--json"))["notes"]
    named = ", ".join(sorted(left)[1:])  # not lm_head: transformers' skip, named on the line before
    assert (f"4 tensors left at bfloat16, not whole groups of 16 along the last dim (a 2-dim weight in whole groups "
            f"is what compressed-tensors' readers take; an experts module with one such weight whole), their modules "
            f"in the quantization_config's ignore: {named}") in notes


def test_a_trained_mla_down_projection_requantizes_its_sharing_sibling_as_oneshot_would(deepseek, tmp_path):
    """`--quantize nvfp4`'s output (oneshot's sharing: q_a_proj with kv_a_proj_with_mqa) as the release of
    `--quantize_like`: after training changed layer 0's q_a_proj, its sibling is quantized again with their new shared
    scale, the bytes compressed-tensors writes for the trained model with oneshot's sets; every other tensor keeps
    the release's bytes."""
    from safetensors.torch import save_file

    weights = load_safetensors_folder(deepseek)
    linear = _linear(weights)
    left = [n.removesuffix(".weight") for n in linear if n == "lm_head.weight" or weights[n].shape[-1] % 16]
    release = merge_in_process(deepseek, tmp_path / "release", "--quantize", "nvfp4")
    stored = load_safetensors_folder(release)
    attention = "model.layers.0.self_attn."
    trained = dict(weights)
    trained[attention + "q_a_proj.weight"] = weights[attention + "q_a_proj.weight"] * 1.5
    shutil.copytree(deepseek, tmp_path / "trained")
    save_file(trained, str(tmp_path / "trained" / "model.safetensors"), metadata={"format": "pt"})
    got = load_safetensors_folder(merge_in_process(tmp_path / "trained", tmp_path / "out", "--quantize_like", release))
    want, _ = compress_checkpoint(tmp_path / "want", trained, NVFP4, linear, left, ONESHOT)
    redone = [n for n in want if n.startswith((attention + "q_a_proj.", attention + "kv_a_proj_with_mqa."))]
    assert not same_bytes(stored[attention + "kv_a_proj_with_mqa.weight_packed"],
                          want[attention + "kv_a_proj_with_mqa.weight_packed"])  # the shared scale moved it
    assert all(same_bytes(got[n], want[n]) for n in redone)
    assert all(same_bytes(got[n], stored[n]) for n in stored if n not in redone)


def test_int4_quantizes_the_routed_experts_as_compressed_tensors_does(deepseek, tmp_path):
    """The routed experts in INT4 (every other Linear layer bfloat16 and in `ignore`, as Kimi-K2's release lists
    them): compressed-tensors' bytes and config; compressed-tensors' dequantizer and transformers' loader read the
    same values."""
    weights = load_safetensors_folder(deepseek)
    linear = _linear(weights)
    experts = [n for n in linear if ".mlp.experts." in n]
    assert len(experts) == 12
    want, config = compress_checkpoint(tmp_path / "want", weights, INT4, linear,
                                       [n.removesuffix(".weight") for n in linear if n not in experts])
    out = merge_in_process(deepseek, tmp_path / "out", "--quantize", "int4", "--verify")
    got = load_safetensors_folder(out)
    _assert_is(got, want)
    assert sorted(n.removesuffix("_packed") for n in got if n.endswith(".weight_packed")) == experts
    assert _quantization_config(out) == config
    values, loaded = _read_back(out)
    for n, t in loaded.items():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers 5 fuses the experts
            layer, part = n.rsplit(".", 1)
            stacked = [torch.cat([values[f"{layer}.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                       if part == "gate_up_proj" else values[f"{layer}.{e}.down_proj.weight"] for e in range(4)]
            assert torch.equal(t, torch.stack(stacked)), n
        else:
            assert torch.equal(t, values[n].to(t.dtype)), n


def test_an_experts_module_not_in_whole_groups_stays_whole_and_is_named(tmp_path, capsys):
    """Experts 48 wide: down_proj is not whole groups of 32, and with it its experts module stays bfloat16 (gate
    and up too), as transformers and vLLM read a layer's experts in one scheme; `inspect` names them."""
    torch.manual_seed(0)
    folder = _save(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **dict(DEEPSEEK_64, moe_intermediate_size=48))), tmp_path / "deepseek48")
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", folder, "--quantize", "int4",
                                         "--json"))["notes"]
    assert any(n.startswith("0 tensors written as compressed-tensors INT4 (int4, the routed experts)") for n in notes)
    (left,) = [n for n in notes if n.startswith("12 tensors left at bfloat16, not whole groups of 32 along")]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in left


def test_int4_of_a_model_without_routed_experts_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    folder = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)), tmp_path / "llama")
    code, errors = merge_here(capsys, "--local_dir", folder, "--target_dir", tmp_path / "out", "--quantize", "int4")
    assert code == 1 and errors == [f"merger: error: --quantize int4 writes the routed experts (Kimi-K2's scheme), "
                                    f"and this model has none (model_type 'llama'), {folder / 'config.json'}"]
    assert not (tmp_path / "out").exists()
