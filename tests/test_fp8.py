"""FP8 block-scaled HF releases (DeepSeek-V3/R1 style) merged into a plain model.

The release is made by tests/writers/fp8_release.py: a tiny transformers Llama whose linear weights are
quantized to float8_e4m3fn with one float32 `weight_scale_inv` per block, config.json naming the scheme as
transformers' FineGrainedFP8Config does. Oracle: the block dequantization written below on whole tensors (a
gather of each element's block scale, nothing of merger's), compared byte for byte in float32 and after the
same bfloat16 cast; the output must load in transformers with no missing or unexpected keys and no
quantization_config.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers.files import snapshot
from tests.helpers.in_process import merge_here
from tests.helpers.processes import run_merger
from tests.helpers.weights import load_safetensors_folder
from tests.writers.fp8_release import FIRST_SCALE, SHARD1, SHARD2, TINY, write_release

pytestmark = pytest.mark.slow


def dequantized(release: Path) -> dict[str, torch.Tensor]:
    """The oracle: every non-scale tensor of the release in float32, quantized ones times their block scale."""
    state = load_safetensors_folder(release)
    block = json.loads((release / "config.json").read_text())["quantization_config"]["weight_block_size"]
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")
        if scale is None:
            out[name] = t.float()
            continue
        rows = torch.arange(t.shape[0]) // block[0]  # each element's block: scale[i // b0, j // b1]
        cols = torch.arange(t.shape[1]) // block[1]
        out[name] = t.float() * scale[rows[:, None], cols[None, :]]
    return out


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    cache: dict = {}

    def make(block=(16, 16), quant_method="fp8") -> Path:
        key = (tuple(block), quant_method)
        if key not in cache:
            cache[key] = write_release(tmp_path_factory.mktemp("fp8") / "release", block, quant_method)
        return cache[key]

    return make


@pytest.fixture
def release(releases, tmp_path) -> Path:
    """A copy of the [16, 16] release, free to break."""
    return Path(shutil.copytree(releases(), tmp_path / "release"))


def assert_plain_model(out: Path, release: Path, dtype: torch.dtype) -> None:
    want = dequantized(release)
    got = load_safetensors_folder(out)
    assert sorted(got) == sorted(want)  # every scale dropped, every weight there
    for name, t in want.items():
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], t.to(dtype)), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=dtype)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert not hasattr(model.config, "quantization_config")
    loaded = model.state_dict()
    for name, t in want.items():
        assert torch.equal(loaded[name], t.to(dtype)), name


@pytest.mark.parametrize("block, dtype, nproc", [
    ((16, 16), "float32", 1),
    ((16, 16), "bfloat16", 3),
    ((128, 128), "bfloat16", 1),  # one partial block covers each weight
    ((128, 128), "float32", 3),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_fp8_release_merges_into_the_dequantized_model(releases, tmp_path, block, dtype, nproc):
    release = releases(block)
    before = snapshot(release)
    out = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", release, "--target_dir", out, "--dtype", dtype, "--max_shard_size",
                      "40KB", nproc=nproc)
    assert f"FP8 block-scaled weights (block {block[0]}x{block[1]}), 14 tensors dequantized" in proc.stderr
    assert len(list(out.glob("*.safetensors"))) > 1
    assert_plain_model(out, release, getattr(torch, dtype))
    assert snapshot(release) == before


@pytest.mark.parametrize("block", [(4, 4), (128, 128)], ids=["4x4", "128x128"])
def test_bfloat16_merge_equals_transformers_own_dequantization(releases, tmp_path, capsys, block):
    """transformers' FP8 loader, told to dequantize, is a second oracle where it applies: its block is the weight
    over the scale grid, so it takes blocks that divide every weight (4x4 here) or one block per weight."""
    release, out = releases(block), tmp_path / "out"
    assert merge_here(capsys, "--local_dir", release, "--target_dir", out) == (0, [])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        release, dtype=torch.bfloat16, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    loaded, ours = model.state_dict(), load_file(out / "model.safetensors")
    assert sorted(loaded) == sorted(ours)
    assert all(torch.equal(loaded[name], t) for name, t in ours.items())


def test_inspect_names_the_fp8_scheme(releases):
    proc = run_merger("inspect", "--local_dir", releases(), "--json")
    info = json.loads(proc.stdout)
    assert info["notes"][0] == ("FP8 block-scaled weights (block 16x16), 14 tensors dequantized; quantization_config "
                                "left out of config.json")
    assert info["output_tensors"] == len(dequantized(releases()))


def test_dtype_keep_writes_dequantized_weights_in_float32_and_merger_test_compares(releases, tmp_path, capsys):
    from merger.cli import main

    release, out = releases(), tmp_path / "out"
    assert merge_here(capsys, "--local_dir", release, "--target_dir", out, "--dtype", "keep") == (0, [])
    want, got = dequantized(release), load_file(out / "model.safetensors")
    source = load_safetensors_folder(release)
    for name, t in want.items():
        kept = torch.float32 if name + "_scale_inv" in source else source[name].dtype
        assert got[name].dtype == kept and torch.equal(got[name], t.to(kept)), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # `merger test` merges in each tensor's own dtype and compares after casting to the reference's
    bf16 = tmp_path / "bf16"
    assert merge_here(capsys, "--local_dir", release, "--target_dir", bf16) == (0, [])
    assert main(["test", "--local_dir", str(release), "--test_hf_dir", str(bf16)]) == 0


def _rewrite(release: Path, file: str, change) -> Path:
    path = release / file
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))
    index = json.loads((release / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file} | dict.fromkeys(tensors, file)
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _refused(capsys, release: Path, tmp_path: Path, *extra) -> str:
    before = snapshot(release)
    out = tmp_path / "out"
    code, errors = merge_here(capsys, "--local_dir", release, "--target_dir", out, *extra)
    assert code != 0 and len(errors) == 1, errors
    assert not out.exists() and snapshot(release) == before
    return errors[0]


def test_a_weight_without_its_scale_is_an_error(release, tmp_path, capsys):
    _rewrite(release, SHARD2, lambda t: t.pop(FIRST_SCALE))
    error = _refused(capsys, release, tmp_path)
    assert error == (f"merger: error: tensor model.layers.0.self_attn.q_proj.weight is stored as float8_e4m3fn with "
                     f"no {FIRST_SCALE} beside it, {release / SHARD1}")


def test_a_scale_without_its_weight_is_an_error(release, tmp_path, capsys):
    path = _rewrite(release, SHARD1, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    error = _refused(capsys, release, tmp_path)
    assert error == ("merger: error: scale model.layers.0.mlp.up_proj.weight_scale_inv has no weight "
                     f"model.layers.0.mlp.up_proj.weight beside it, {path}")


def test_a_scale_of_the_wrong_grid_is_an_error(release, tmp_path, capsys):
    path = _rewrite(release, SHARD2, lambda t: t.update({FIRST_SCALE: torch.ones(2, 2)}))
    error = _refused(capsys, release, tmp_path)
    assert error == (f"merger: error: scale {FIRST_SCALE} is [2, 2], but weight model.layers.0.self_attn.q_proj.weight"
                     f" [40, 40] in blocks of 16x16 needs [3, 3], {path}")


@pytest.mark.parametrize("block", [[16], [0, 16], "16x16"])
def test_a_bad_block_size_is_an_error(release, tmp_path, capsys, block):
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (release / "config.json").write_text(json.dumps(config))
    error = _refused(capsys, release, tmp_path)
    assert error == (f"merger: error: quantization_config.weight_block_size is {block!r}, not two positive "
                     f"integers, {release / 'config.json'}")


def test_another_quant_method_is_refused(releases, tmp_path, capsys):
    """Not FP8 blocks: its tensors copied as they are would be written as if they were weights, even under --dtype
    keep (tests/test_quantized_refusals.py: the formats of 2026, written by compressed-tensors)."""
    release = releases(quant_method="some-other-method")
    error = _refused(capsys, release, tmp_path, "--dtype", "keep")
    assert error.startswith("merger: error: quant_method 'some-other-method' weights (config.json's "
                            "quantization_config), a quantized format merger does not handle") and \
        error.endswith(f", {release / 'config.json'}"), error


@pytest.mark.parametrize("key, value, what", [
    ("expert_dtype", "int4", "FP8 weights with int4 experts"),
    ("weight_block_size", None, "FP8 weights scaled per tensor or per channel, without weight_block_size")])
def test_an_fp8_layout_without_blocks_of_float8_everywhere_is_refused(release, key, value, what, tmp_path, capsys):
    """Experts in a dtype merger does not know (DeepSeek-V4's FP4 it reads: test_deepseek_v4_read.py) and FP8 scaled
    per tensor are not the block layout dequantized above."""
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"][key] = value
    if value is None:
        del config["quantization_config"][key]
    (release / "config.json").write_text(json.dumps(config))
    error = _refused(capsys, release, tmp_path)
    assert error.startswith(f"merger: error: {what} (config.json's quantization_config), a quantized format merger "
                            f"does not handle") and error.endswith(f", {release / 'config.json'}"), error


def test_float8_weights_that_no_config_describes_are_not_cast_without_their_scales(tmp_path, capsys):
    """--dtype bfloat16 on float8 weights merger does not dequantize would write values off by their scales."""
    folder = tmp_path / "float8"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.float8_e4m3fn).save_pretrained(folder)
    error = _refused(capsys, folder, tmp_path)
    assert error.startswith("merger: error: tensor ") and " is stored as float8_e4m3fn, and a cast to bfloat16 " \
        "without its scales would change its values" in error and error.endswith(str(folder / "config.json")), error
