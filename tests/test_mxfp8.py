"""transformers' `mxfp8` releases (`quant_method: "mxfp8"`: float8_e4m3fn weights, one e8m0 byte per block of 1x32,
`weight_scale_inv` uint8 [out, in / 32]) read by `merge` and written back by `--quantize_like`, or written from a
model with no release by `--quantize mxfp8`.

The release is written by transformers itself (tests/writers/mxfp8_release.py: its `Fp8Quantize` on a tiny bfloat16
Llama, saved by save_pretrained). Oracles, none of them merger's code:
- reading: transformers loading the release on CPU (it dequantizes FP8 there; its `Fp8Dequantize` reads uint8
  scales as 2^(byte - 127) and takes the block from the scale grid), and the e8m0 definition computed below in
  float64 on whole tensors (exact: a float8 value times a power of two), both bit for bit (compared as integers, so
  -0.0 counts) at bfloat16 and float32;
- writing: transformers' `Fp8Quantize` with the release's own config on the same weights, byte for byte, and the
  release itself (quantized from the same bfloat16 weights by that op) for names, dtypes, bytes and config;
- the round trip release -> plain model -> `--quantize_like` the release: every byte of the release, also in the
  blocks where transformers' rule on the same values would write other bytes (FORMATS.md);
- a LoRA folded into the release: PEFT's merge on the base transformers dequantizes, then `Fp8Quantize` on the
  weights it changed, the release's bytes for the others.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tests.helpers.in_process import merge_here, merge_in_process, stdout_in_process
from tests.helpers.weights import load_safetensors_folder
from tests.writers.mxfp8_release import transformers_quantized, write_release

pytestmark = pytest.mark.slow

SCALE = "_scale_inv"
BLOCK = 32
INTS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(the mxfp8 release, the model it quantizes: bfloat16)."""
    root = tmp_path_factory.mktemp("mxfp8")
    return write_release(root / "release", reference=root / "model"), root / "model"


def e8m0_dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle by definition, in float64: each weight with a scale times 2^(byte - 127) of its 1x32 block."""
    out = {}
    for name, t in state.items():
        if name.endswith(SCALE):
            continue
        scale = state.get(name + SCALE)
        out[name] = t.double() if scale is None else \
            t.double() * torch.pow(2.0, scale.double() - 127).repeat_interleave(BLOCK, dim=-1)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INTS[t.dtype]) if t.dtype in INTS else t.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_dequantizes_as_transformers_and_the_e8m0_definition(release, tmp_path, capsys, dtype):
    folder, _ = release
    out = merge_in_process(folder, tmp_path / "out", "--dtype", dtype)
    got, stored = load_safetensors_folder(out), load_safetensors_folder(folder)
    assert sum(n.endswith(SCALE) and t.dtype == torch.uint8 for n, t in stored.items()) == 14
    want = e8m0_dequantized(stored)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == DTYPES[dtype] and torch.equal(bits(got[name]), bits(t.to(DTYPES[dtype]))), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype],
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(got)
    for name, t in got.items():
        assert torch.equal(bits(loaded[name]), bits(t)), name
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", folder, "--json"))["notes"]
    assert notes[0] == ("FP8 block-scaled weights (mxfp8: block 1x32, e8m0 scales), 14 tensors dequantized; "
                        "quantization_config left out of config.json")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_like_is_transformers_quantizer_and_the_release_itself(release, tmp_path, capsys, dtype):
    """The model the release quantizes, written like it: transformers' quantize op on the weights at --dtype,
    byte for byte, which here is every byte of the release (bfloat16 weights hold the same values in float32)."""
    folder, model = release
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", model, "--target_dir", out, "--quantize_like", folder,
                      "--dtype", dtype) == (0, [])
    got, stored, weights = (load_safetensors_folder(f) for f in (out, folder, model))
    assert sorted(got) == sorted(stored)
    quantized = [n for n in stored if n + SCALE in stored]
    assert len(quantized) == 14
    for name in quantized:
        weight, scale = transformers_quantized(name, weights[name].to(DTYPES[dtype]))
        assert torch.equal(bits(got[name]), bits(weight)) and torch.equal(got[name + SCALE], scale), name
    for name, t in stored.items():
        assert got[name].dtype == t.dtype and torch.equal(bits(got[name]), bits(t)), name
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (out, folder))
    assert config["quantization_config"] == release_config["quantization_config"]
    assert release_config["quantization_config"]["quant_method"] == "mxfp8"
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", model, "--quantize_like", folder,
                                         "--json"))["notes"]
    assert (f"14 tensors written as FP8 like {folder} (float8_e4m3fn, block 1x32, weight_scale_inv uint8 (e8m0), "
            f"scale_fmt ue8m0); quantization_config copied into config.json") in notes


def test_quantize_mxfp8_without_a_release_writes_the_release_transformers_writes(release, tmp_path, capsys):
    """`--quantize mxfp8` on the model alone: transformers' default choice of modules (every Linear but lm_head),
    its quantize op, its config: the release transformers wrote of this model, every byte and the
    quantization_config."""
    folder, model = release
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", model, "--target_dir", out, "--quantize", "mxfp8", "--verify") == (0, [])
    got, stored = load_safetensors_folder(out), load_safetensors_folder(folder)
    assert sorted(got) == sorted(stored) and sum(n.endswith(SCALE) for n in got) == 14
    for name, t in stored.items():
        assert got[name].dtype == t.dtype and torch.equal(bits(got[name]), bits(t)), name
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (out, folder))
    assert config["quantization_config"] == release_config["quantization_config"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_keeps_every_byte_of_the_release(release, tmp_path, dtype):
    """release -> plain model at --dtype -> `--quantize_like` the release: every byte of the release, although
    transformers' own rule, on the same values, gives other bytes in some blocks (the premise, checked here): a
    block's scale is the smallest power of two 2^e with amax <= 448 * 2^e, so where the release's largest code
    rounded down to 224 (amax / 2^e in (224, 232]), the dequantized amax is 448 * 2^(e - 1) and the rule picks
    2^(e - 1), every code doubled. Such a block's values are the release's, so it keeps the release's bytes."""
    folder, _ = release
    plain = merge_in_process(folder, tmp_path / "plain", "--dtype", dtype)
    back = merge_in_process(plain, tmp_path / "back", "--quantize_like", folder, "--dtype", dtype)
    got, stored, merged = (load_safetensors_folder(f) for f in (back, folder, plain))
    assert sorted(got) == sorted(stored)
    for name, t in stored.items():
        assert got[name].dtype == t.dtype and torch.equal(bits(got[name]), bits(t)), name
    lowered = total = 0
    for name in (n for n in stored if n + SCALE in stored):
        _, scale = transformers_quantized(name, merged[name])
        lowered, total = lowered + int((scale != stored[name + SCALE]).sum()), total + scale.numel()
    assert total == 1920 and 0 < lowered < total / 10, (lowered, total)


@pytest.mark.parametrize("key, value, error", [
    ("weight_block_size", [1, 16], "transformers' mxfp8 weights (weight_block_size [1, 16], scale_fmt 'ue8m0', "
                                   "expert_dtype 'fp8')"),
    ("scale_fmt", "float", "transformers' mxfp8 weights (weight_block_size [1, 32], scale_fmt 'float', "
                           "expert_dtype 'fp8')"),
], ids=["other-blocks", "float-scales"])
def test_mxfp8_in_another_scheme_is_refused(release, tmp_path, capsys, key, value, error):
    folder = shutil.copytree(release[0], tmp_path / "release")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    code, errors = merge_here(capsys, "--local_dir", folder, "--target_dir", tmp_path / "out")
    assert code == 1 and len(errors) == 1 and errors[0].startswith(
        f"merger: error: {error} (config.json's quantization_config), a quantized format merger does not handle"), \
        errors
    assert errors[0].endswith(f", {folder / 'config.json'}") and not (tmp_path / "out").exists()


def test_e8m0_bytes_under_fp8_without_ue8m0_are_refused(release, tmp_path, capsys):
    """A uint8 scale is e8m0 bytes only where scale_fmt says ue8m0: elsewhere nothing says what it is."""
    folder = shutil.copytree(release[0], tmp_path / "release")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(quant_method="fp8", scale_fmt="float")
    (folder / "config.json").write_text(json.dumps(config))
    code, errors = merge_here(capsys, "--local_dir", folder, "--target_dir", tmp_path / "out")
    assert code == 1 and len(errors) == 1 and errors[0].startswith("merger: error: scale model.") and \
        errors[0].endswith(f"_scale_inv is stored as uint8, not as floats, {folder / 'model.safetensors'}"), errors


def test_weights_larger_than_a_band_give_the_same_bytes():
    """merger works on bands of block rows (about 4M elements); a stacked weight that spans three bands, the last
    partial, quantizes to transformers' bytes and dequantizes to the e8m0 definition."""
    from merger.mapping.fp8 import band_rows, dequantize
    from merger.mapping.fp8_quantize import quantize

    torch.manual_seed(1)
    weight = (torch.randn(2, 4136, 1056) / 50).to(torch.bfloat16)
    assert 1 < -(-weight.shape[-2] // band_rows(tuple(weight.shape), (1, BLOCK))) == 3
    codes, scale = quantize((1, BLOCK), True, weight, torch.uint8)
    want_codes, want_scale = transformers_quantized("w.weight", weight)
    assert torch.equal(bits(codes), bits(want_codes)) and torch.equal(scale, want_scale)
    (values,) = dequantize((1, BLOCK), [codes, scale])
    assert torch.equal(bits(values), bits(e8m0_dequantized({"w": codes, "w" + SCALE: scale})["w"].float()))


def test_lora_folded_into_an_mxfp8_base_is_peft_merge_then_transformers_quantizer(release, tmp_path):
    """The oracle: transformers loads the release dequantized (float32, on CPU), PEFT merges the adapter into it,
    transformers' quantize op quantizes the weights it changed, the others are the release's bytes; `merger lora` keeps the base's mxfp8 layout (uint8 scales)."""
    import peft
    from merger.cli import main

    folder, _ = release
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "down_proj"])
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    assert main(["lora", "--base_model", str(folder), "--adapter", str(tmp_path / "adapter"), "--target_dir",
                 str(tmp_path / "out")]) == 0
    got, stored = load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(folder)
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in stored.items()}
    quantized = [n for n in stored if n + SCALE in stored]
    adapted = [n for n in quantized if n.split(".")[-2] in ("q_proj", "down_proj")]
    assert len(adapted) == 4 and not any(torch.equal(bits(got[n]), bits(stored[n])) for n in adapted)
    for name in adapted:
        weight, scale = transformers_quantized(name, want[name])
        assert torch.equal(bits(got[name]), bits(weight)) and torch.equal(got[name + SCALE], scale), name
    for name in set(quantized) - set(adapted):  # what the adapter leaves alone keeps the release's bytes
        assert torch.equal(bits(got[name]), bits(stored[name])) and torch.equal(got[name + SCALE],
                                                                                stored[name + SCALE]), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == \
        json.loads((folder / "config.json").read_text())["quantization_config"]
