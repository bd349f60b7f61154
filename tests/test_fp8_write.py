"""`--quantize_like RELEASE`: a model written back in its release's FP8 block-scaled layout.

The releases are made by tests/writers/fp8_release.py (a tiny DeepSeek-V3: MLA, a dense and a MoE layer; blocks
of 16x16 leave partial edge blocks, 4x4 divide every weight; `scale_fmt: "ue8m0"` or not), the model merged is
the same model unquantized. Oracles: transformers' own quantizer (`Fp8Quantize._quantize_one`) on the same
bfloat16 weights, byte for byte, weights and scales (transformers quantizes only whole blocks: a weight with
partial edge blocks is handed to it padded with zeros, which changes no amax, and its result cut back); the
release itself for every other tensor's dtype and for quantization_config; transformers loading the output, whose
logits stay within FP8's error of the bfloat16 model's; the one-process merge for the merge ranks'.
"""
from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from merger.mapping import fp8_quantize
from tests.helpers.files import snapshot
from tests.helpers.in_process import merge_here, merge_in_process, run_in_process
from tests.helpers.processes import run_merger
from tests.helpers.weights import load_safetensors_folder
from tests.writers.fp8_release import write_release

pytestmark = pytest.mark.slow

CASES = [((16, 16), None), ((16, 16), "ue8m0"), ((4, 4), None), ((4, 4), "ue8m0")]
IDS = ["16x16", "16x16-ue8m0", "4x4", "4x4-ue8m0"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """make(block, scale_fmt) -> (release, the model unquantized in float32): one seeded model for all."""
    root = tmp_path_factory.mktemp("fp8_write")
    cache = {}

    def make(block, scale_fmt):
        key = (block, scale_fmt)
        if key not in cache:
            name = f"release-{block[0]}x{block[1]}-{scale_fmt}"
            cache[key] = write_release(root / name, block, family="deepseek_v3", reference=root / f"{name}-ref",
                                       scale_fmt=scale_fmt), root / f"{name}-ref"
        return cache[key]

    return make


def transformers_quantized(weight: torch.Tensor, block, scale_fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' quantizer on `weight`, zero-padded to whole blocks and cut back; its scales as float32."""
    config = transformers.FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt or "float")
    rows, cols = weight.shape
    padded = F.pad(weight, (0, -cols % block[1], 0, -rows % block[0]))
    out = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one("w.weight", padded)
    return out["w.weight"][:rows, :cols], out["w.weight_scale_inv"].float()


def logits_loaded(out, reference) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits of `out` as transformers loads it, every tensor read; the `reference` model's at bfloat16)."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)
    tokens = torch.tensor([[1, 5, 7, 9, 11, 3, 42, 60]])
    with torch.no_grad():
        return loaded.eval()(tokens).logits.float(), bf16.eval()(tokens).logits.float()


def quantized_like(capsys, tmp_path, source, release, *extra):
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", source, "--target_dir", out, "--quantize_like", release, *extra) == (0, [])
    return out


@pytest.mark.parametrize("block, scale_fmt", CASES, ids=IDS)
def test_weights_and_scales_are_transformers_quantizer_s(deepseek, tmp_path, capsys, block, scale_fmt):
    release, reference = deepseek(block, scale_fmt)
    out = quantized_like(capsys, tmp_path, reference, release)
    got, stored, model = (load_safetensors_folder(f) for f in (out, release, reference))
    assert sorted(got) == sorted(stored)
    quantized = [n for n in stored if n + "_scale_inv" in stored]
    assert len(quantized) == 28
    for name, t in got.items():
        assert t.dtype == stored[name].dtype, name  # the release's dtypes, scales float32
    for name in quantized:
        weight, scale = transformers_quantized(model[name].bfloat16(), block, scale_fmt)
        assert torch.equal(got[name].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(got[name + "_scale_inv"], scale), name
    for name in set(stored) - set(quantized) - {n + "_scale_inv" for n in quantized}:
        assert torch.equal(got[name], model[name].to(stored[name].dtype)), name
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (out, release))
    assert config["quantization_config"] == release_config["quantization_config"]


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_transformers_loads_the_output_within_fp8_error(deepseek, tmp_path, capsys, scale_fmt):
    """transformers (on CPU: dequantizing as it loads, which takes blocks that divide every weight) loads every
    tensor; float8_e4m3fn holds 3 mantissa bits, so each weight is within 2^-4 of itself relative to its block's
    largest, and the logits stay within that fraction of the bfloat16 model's largest."""
    release, reference = deepseek((4, 4), scale_fmt)
    out = quantized_like(capsys, tmp_path, reference, release)
    assert transformers.AutoConfig.from_pretrained(out).quantization_config["weight_block_size"] == [4, 4]
    got, want = logits_loaded(out, reference)
    assert 0 < (got - want).abs().max() < 2 ** -4 * want.abs().max()


def test_the_log_and_inspect_say_what_is_quantized(deepseek, tmp_path):
    release, reference = deepseek((16, 16), "ue8m0")
    proc = run_merger("inspect", "--local_dir", reference, "--quantize_like", release, "--json")
    assert (f"28 tensors written as FP8 like {release} (float8_e4m3fn, block 16x16, weight_scale_inv float32, "
            f"scale_fmt ue8m0); quantization_config copied into config.json") in json.loads(proc.stdout)["notes"]


def test_an_fp8_release_requantized_like_itself_keeps_its_config(deepseek, tmp_path, capsys):
    """Reading an FP8 release drops quantization_config; writing one like it puts it back."""
    release, _ = deepseek((16, 16), None)
    out = quantized_like(capsys, tmp_path, release, release)
    got, stored = load_safetensors_folder(out), load_safetensors_folder(release)
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in stored.items()}
    assert "quantization_config" in json.loads((out / "config.json").read_text())


def test_a_release_of_another_model_is_refused(deepseek, tmp_path, capsys):
    release, reference = deepseek((16, 16), None)
    other = shutil.copytree(reference, tmp_path / "other")
    state = load_safetensors_folder(other)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    state[name] = state[name][:-1]
    for file in other.glob("*.safetensors"):
        file.unlink()
    from safetensors.torch import save_file
    save_file(state, str(other / "model.safetensors"))
    before = snapshot(other)
    code, errors = merge_here(capsys, "--local_dir", other, "--target_dir", tmp_path / "out", "--quantize_like",
                              release)
    assert code == 1 and errors == [f"merger: error: tensor {name} is [19, 40] here but [20, 40] in the release: "
                                    f"--quantize_like needs the release of this model, {release}"]
    assert not (tmp_path / "out").exists() and snapshot(other) == before


def test_a_release_that_is_not_fp8_is_refused(deepseek, tmp_path, capsys):
    _, reference = deepseek((16, 16), None)
    code, errors = merge_here(capsys, "--local_dir", reference, "--target_dir", tmp_path / "out", "--quantize_like",
                              reference)
    assert code == 1 and errors == [f"merger: error: --quantize_like needs an FP8 block-scaled release: its "
                                    f"config.json's quantization_config must say quant_method fp8 with a "
                                    f"weight_block_size, {reference / 'config.json'}"]


def test_merge_ranks_equal_one_process_over_fsdp_shards(deepseek_v3_root, tmp_path):
    """torchtitan's DeepSeek-V3 saved on 2 FSDP ranks: its weights' row shards end inside 16-row blocks, so a
    block's amax spans the two files. 2 merge ranks write the bytes 1 does."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(deepseek_v3_root / "checkpoint" / "step-1").read_metadata().state_dict_metadata
    assert any(chunk.offsets[0] % 16 for m in metadata.values() if len(getattr(m, "size", ())) == 2
               for chunk in m.chunks)  # a row shard that starts inside a block
    args = ["--local_dir", deepseek_v3_root / "checkpoint" / "step-1", "--hf_model_config_path",
            deepseek_v3_root / "hf"]
    run_in_process("merge", *args, "--target_dir", tmp_path / "fp32", "--dtype", "float32")
    release = write_release(tmp_path / "release", (16, 16), model_dir=tmp_path / "fp32", scale_fmt="ue8m0")
    for nproc in (1, 2):
        run_merger("merge", *args, "--target_dir", tmp_path / f"fp8-{nproc}", "--quantize_like", release,
                   "--max_inflight", "64KiB", nproc=nproc)
    one, two = load_safetensors_folder(tmp_path / "fp8-1"), load_safetensors_folder(tmp_path / "fp8-2")
    assert sorted(one) == sorted(two) and sum(t.dtype == torch.float8_e4m3fn for t in one.values()) > 10
    assert all(torch.equal(one[n].view(torch.uint8), two[n].view(torch.uint8)) for n in one)


# --quantize fp8-block: a base with no FP8 release, in transformers' default choice of modules.
WHOLE_BLOCKS = dict(vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # dims of 128s


def transformers_converts(folder) -> set[str]:
    """The oracle's choice: the modules transformers' FP8 quantizer, quantizing on load (not pre-quantized) with
    its default config, turns into FP8 modules, as from_pretrained prepares the model before loading weights."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    quantizer = FineGrainedFP8HfQuantizer(transformers.FineGrainedFP8Config())
    quantizer.pre_quantized = False
    quantizer._process_model_before_weight_loading(model)
    return {name for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}


@pytest.fixture(scope="module")
def llama_128(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama_128") / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**WHOLE_BLOCKS)).save_pretrained(folder)
    return folder


def test_quantize_fp8_block_is_transformers_quantizer_on_its_default_modules(llama_128, tmp_path, capsys):
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", llama_128, "--target_dir", out, "--quantize", "fp8-block") == (0, [])
    got, model = load_safetensors_folder(out), load_safetensors_folder(llama_128)
    quantized = {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}
    assert quantized == {m + ".weight" for m in transformers_converts(llama_128)} and len(quantized) == 7
    assert set(got) == set(model) | {n + "_scale_inv" for n in quantized}
    for name in quantized:
        weight, scale = transformers_quantized(model[name].bfloat16(), (128, 128), None)
        assert torch.equal(got[name].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(got[name + "_scale_inv"], scale), name
    for name in set(model) - quantized:  # lm_head, embeddings, norms
        assert torch.equal(got[name], model[name].bfloat16()), name
    have, want = logits_loaded(out, llama_128)
    assert 0 < (have - want).abs().max() < 2 ** -4 * want.abs().max()


@pytest.fixture(scope="module")
def llama_136(tmp_path_factory):
    """llama_128 with a 136-wide MLP: gate/up [136, 256] and down [256, 136] are not whole 128x128 blocks."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama_136") / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**WHOLE_BLOCKS, "intermediate_size": 136})
                                  ).save_pretrained(folder)
    return folder


def test_quantize_fp8_block_leaves_partial_blocks_unquantized_as_transformers(llama_136, tmp_path, capsys):
    """transformers' Fp8Quantize quantizes only whole blocks, and transformers reads a partial block's scale grid
    wrongly, with no warning (the MLP 17% off here, the logits 8% of the largest): the MLP stays bfloat16, listed
    in modules_to_not_convert, so transformers loads it as a plain Linear and the logits are the bfloat16 model's
    within FP8's error (the attention's)."""
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", llama_136, "--target_dir", out, "--quantize", "fp8-block") == (0, [])
    got, model = load_safetensors_folder(out), load_safetensors_folder(llama_136)
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=transformers.FineGrainedFP8Config()))
    converted = {m + ".weight" for m in transformers_converts(llama_136)}
    for name in converted:  # the oracle: what transformers' quantizer makes of each weight it converts
        want = quantizer._quantize_one(name, model[name].bfloat16())
        assert {n: t.dtype for n, t in want.items()} == {n: got[n].dtype for n in want}, name
        assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items()), name
    partial = {n for n in converted if got[n].dtype == torch.bfloat16}
    assert partial == {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    have, want = logits_loaded(out, llama_136)
    assert 0 < (have - want).abs().max() < 2 ** -4 * want.abs().max()
    proc = run_merger("inspect", "--local_dir", llama_136, "--quantize", "fp8-block", "--json")
    assert ("3 tensors left at bfloat16, not whole 128x128 blocks (transformers' Fp8Quantize quantizes only "
            "whole blocks), their modules in modules_to_not_convert: model.layers.0.mlp.down_proj.weight, "
            "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight"
            ) in json.loads(proc.stdout)["notes"]


def test_quantize_fp8_block_on_moe_experts_with_partial_blocks(deepseek, tmp_path, capsys):
    """DeepSeek-V3 with every dim under 128: each module transformers converts (attention, dense MLP, shared and
    routed experts, saved one by one) has partial blocks, which Fp8Quantize leaves as they are; so all stay
    bfloat16, named in modules_to_not_convert (an experts module whole), and transformers loads the bfloat16 model's
    logits."""
    _, reference = deepseek((16, 16), None)
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", reference, "--target_dir", out, "--quantize", "fp8-block") == (0, [])
    got, model = load_safetensors_folder(out), load_safetensors_folder(reference)
    converted = transformers_converts(reference)
    weights = {n for n in model if n.removesuffix(".weight") in converted
               or any(n.startswith(m + ".") for m in converted if m.endswith(".experts"))}
    assert len(weights) == 28 and all(got[n].dtype == torch.bfloat16 for n in weights)
    assert set(got) == set(model)
    skipped = transformers.AutoConfig.from_pretrained(out).quantization_config["modules_to_not_convert"]
    assert set(skipped) == converted | {"lm_head"}
    proc = run_merger("inspect", "--local_dir", reference, "--quantize", "fp8-block", "--json")
    assert ("28 tensors left at bfloat16, not whole 128x128 blocks (transformers' Fp8Quantize quantizes only whole "
            "blocks), their modules in modules_to_not_convert: model.layers.0.mlp.down_proj.weight, "
            "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight, "
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight, model.layers.0.self_attn.kv_b_proj.weight, ..."
            ) in json.loads(proc.stdout)["notes"]
    have, want = logits_loaded(out, reference)
    assert torch.equal(have, want)


def test_quantize_and_quantize_like_together_are_refused(deepseek, tmp_path, capsys):
    release, reference = deepseek((16, 16), None)
    code, errors = merge_here(capsys, "--local_dir", reference, "--target_dir", tmp_path / "out", "--quantize",
                              "fp8-block", "--quantize_like", release)
    assert code == 1 and errors == [f"merger: error: --quantize_like and --quantize both say how to quantize: pass "
                                    f"one, {release}"]


# A PEFT adapter folded into an FP8 release: dequantized, folded, requantized (--dtype keep) or cast.
@pytest.mark.parametrize("targets, adapted_by, count", [
    (["q_a_proj", "kv_b_proj", "o_proj"], lambda name: name.split(".")[-2] in ("q_a_proj", "kv_b_proj", "o_proj"), 6),
    # PEFT turns these on transformers 5's fused experts into target_parameters (LoRA on the expert tensors
    # themselves, gate_up_proj and down_proj), which the release stores per expert
    (["gate_proj", "up_proj", "down_proj"], lambda name: ".mlp.experts." in name, 12),
], ids=["attention", "moe_experts"])
def test_lora_folded_into_an_fp8_base_is_peft_merge_then_transformers_quantizer(targets, adapted_by, count,
                                                                                  deepseek, tmp_path, capsys):
    """The oracle: transformers loads the release dequantized (float32), PEFT merges the adapter into it
    (merge_and_unload, saved by save_pretrained), transformers' quantizer quantizes the weights the adapter
    changed, and the others are the release's own bytes; `merger lora` keeps the base's FP8 layout by default, and `--dtype bfloat16` writes PEFT's merge in bfloat16."""
    import peft
    from merger.cli import main

    release, _ = deepseek((4, 4), "ue8m0")  # blocks that transformers' dequantizing loader takes
    base = transformers.AutoModelForCausalLM.from_pretrained(
        release, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        release, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    merged.save_pretrained(tmp_path / "peft-merged")
    want = load_safetensors_folder(tmp_path / "peft-merged")
    stored = load_safetensors_folder(release)

    assert main(["lora", "--base_model", str(release), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "fp8")]) == 0
    got = load_safetensors_folder(tmp_path / "fp8")
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in stored.items()}
    quantized = [n for n in stored if n + "_scale_inv" in stored]
    adapted = [n for n in quantized if adapted_by(n)]
    assert len(adapted) == count and not any(torch.equal(got[n].float(), stored[n].float()) for n in adapted)
    for name in adapted:
        weight, scale = transformers_quantized(want[name], (4, 4), "ue8m0")
        assert torch.equal(got[name].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(got[name + "_scale_inv"], scale), name
    for name in set(quantized) - set(adapted):  # what the adapter leaves alone keeps the release's bytes
        assert torch.equal(got[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(got[name + "_scale_inv"], stored[name + "_scale_inv"]), name
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"

    assert main(["lora", "--base_model", str(release), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    got = load_safetensors_folder(tmp_path / "bf16")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.to(got[name].dtype)), name
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    capsys.readouterr()


def test_quantize_like_a_hub_id_reads_the_cached_snapshot(deepseek, tmp_path):
    """A release named by its Hub id (HF_HUB_OFFLINE, read from huggingface_hub's cache): the same bytes as the
    folder; with only its config cached, its headers would come from the Hub: offline, one line naming it."""
    from tests.helpers.hub_cache import cache_model, offline_env

    release, reference = deepseek((16, 16), "ue8m0")
    cache_model(tmp_path / "hub", "merger-test/tiny-deepseek-fp8", release)
    run_merger("merge", "--local_dir", reference, "--target_dir", tmp_path / "hub-out", "--quantize_like",
               "merger-test/tiny-deepseek-fp8", env=offline_env(tmp_path / "hub"))
    merge_in_process(reference, tmp_path / "out", "--quantize_like", release)
    assert snapshot(tmp_path / "hub-out")["model.safetensors"][0] == snapshot(tmp_path / "out")["model.safetensors"][0]

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(release / "config.json", config_only)
    cache_model(tmp_path / "hub2", "merger-test/config-only", config_only)
    proc = run_merger("merge", "--local_dir", reference, "--target_dir", tmp_path / "out2", "--quantize_like",
                      "merger-test/config-only", env=offline_env(tmp_path / "hub2"), check=False)
    error = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode == 1 and len(error) == 1 and "Traceback" not in proc.stderr
    assert error[0].startswith("merger: error: --quantize_like: cannot read the safetensors headers of Hub model "
                               "merger-test/config-only ("), error
    assert not (tmp_path / "out2").exists()


def test_quantizing_from_float16_is_refused(deepseek, tmp_path, capsys):
    """float16 would turn weights beyond its range into inf before their block scale is taken: one line."""
    release, reference = deepseek((16, 16), None)
    code, errors = merge_here(capsys, "--local_dir", reference, "--target_dir", tmp_path / "out", "--quantize_like",
                              release, "--dtype", "float16")
    assert code == 1 and errors == [f"merger: error: FP8 output is quantized from the weights at --dtype, and "
                                    f"float16 cannot hold every weight: use --dtype bfloat16 (the default) or "
                                    f"float32, {release}"]
    assert not (tmp_path / "out").exists()


def test_verify_reads_each_quantized_tensor_back_within_fp8_error(llama_128, tmp_path, capsys, monkeypatch):
    """--verify reads the FP8 output back with merger's reader: within e4m3's bound of the weights it passes. A
    quantizer that writes one block's scale twice too large writes the same bytes in --verify's re-run, so only the
    read-back sees it: one line naming the tensor, and nothing at the target."""
    args = ("--local_dir", llama_128, "--quantize", "fp8-block", "--verify")
    assert merge_here(capsys, *args, "--target_dir", tmp_path / "out") == (0, [])
    quantize = fp8_quantize.quantize

    def doubled_last_scale(*a, **kw):
        codes, scales = quantize(*a, **kw)
        scales = scales.clone()
        scales.view(-1)[-1] *= 2
        return codes, scales

    monkeypatch.setattr(fp8_quantize, "quantize", doubled_last_scale)
    assert merge_here(capsys, *args[:-1], "--target_dir", tmp_path / "unverified") == (0, [])  # unseen without it
    code, errors = merge_here(capsys, *args, "--target_dir", tmp_path / "faulty")
    assert code == 1 and len(errors) == 1, errors
    assert re.fullmatch(r"merger: error: --verify: model\.layers\.0\.\S+\.weight, quantized as FP8, reads back \S+ away "
                        r"from its bfloat16 weight at \[\d+, \d+\], beyond the format's bound there \(\S+; \d+ elements "
                        r"beyond it\): the output would not load as the merged weights, and nothing was moved to the "
                        r"target", errors[0]), errors[0]
    assert not (tmp_path / "faulty").exists()
