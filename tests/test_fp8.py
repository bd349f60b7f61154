"""FP8 block-scaled HF releases (DeepSeek-V3/R1 style) merged into a plain model.

The release is made here: a tiny transformers Llama whose linear weights are quantized to float8_e4m3fn with
one float32 `weight_scale_inv` per block, config.json naming the scheme as transformers' FineGrainedFP8Config
does. Oracle: the block dequantization written below on whole tensors (a gather of each element's block
scale, nothing of merger's), compared byte for byte in float32 and after the same bfloat16 cast; the output
must load in transformers with no missing or unexpected keys and no quantization_config.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import load_safetensors_folder, merge_here, run_merger, snapshot

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Dims that leave partial edge blocks in [16, 16]: 40 = 2*16 + 8, 56 = 3*16 + 8, 20 = 16 + 4.
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIRST_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"


def block_scales(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """Each element's scale: scale[i // b0, j // b1], gathered for the whole tensor."""
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale[rows[:, None], cols[None, :]]


def quantize(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv per block): each block's largest magnitude maps to float8's largest."""
    grid = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    scale = torch.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
    return (weight / block_scales(scale, weight.shape, block)).to(torch.float8_e4m3fn), scale


def dequantized(release: Path) -> dict[str, torch.Tensor]:
    """The oracle: every non-scale tensor of the release in float32, quantized ones times their block scale."""
    state = load_safetensors_folder(release)
    block = json.loads((release / "config.json").read_text())["quantization_config"]["weight_block_size"]
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")
        out[name] = t.float() if scale is None else t.float() * block_scales(scale, t.shape, block)
    return out


def write_release(folder: Path, block, quant_method: str = "fp8") -> Path:
    """A tiny Llama as an FP8 release: two safetensors shards with an index, one weight's scale in the other
    shard than its weight; embeddings, norms and lm_head stay bfloat16 (lm_head in modules_to_not_convert)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(config)
    state = {}
    for name, t in model.state_dict().items():
        if name.split(".")[-2] in QUANTIZED:
            state[name], state[name + "_scale_inv"] = quantize(t.float(), block)
        else:
            state[name] = t.to(torch.bfloat16)
    folder.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": quant_method, "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, t in state.items():
        second = name.startswith("model.layers.1.") or name.startswith(("lm_head", "model.norm")) or name == FIRST_SCALE
        shards["model-0000%d-of-00002.safetensors" % (2 if second else 1)][name] = t.contiguous()
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


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


def test_inspect_names_the_fp8_scheme(releases):
    proc = run_merger("inspect", "--local_dir", releases(), "--json")
    info = json.loads(proc.stdout)
    assert info["notes"] == ["FP8 block-scaled weights (block 16x16), 14 tensors dequantized; quantization_config "
                             "left out of config.json"]
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


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


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


def test_another_quant_method_is_left_as_it_is(releases, tmp_path, capsys):
    """Not FP8 blocks: the folder is copied as the plain HF mapping does, tensors and config unchanged."""
    release, out = releases(quant_method="some-other-method"), tmp_path / "out"
    assert merge_here(capsys, "--local_dir", release, "--target_dir", out, "--dtype", "keep") == (0, [])
    source, got = load_safetensors_folder(release), load_safetensors_folder(out)
    assert sorted(got) == sorted(source) and all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8))
                                                 for n, t in source.items())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "some-other-method"
