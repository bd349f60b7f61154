"""ModelOpt NVFP4 and MXFP8 exports merged into a plain model: every quantized weight dequantized, every other
tensor as stored, no quantization_config, no hf_quant_config.json.

The exports are written by ModelOpt itself on CPU (tests/writers/modelopt_release.py: `mtq.quantize` with its
NVFP4 or MXFP8 preset over a few fixed token batches, then `export_hf_checkpoint`). The oracle is ModelOpt's own
dequantizer, `NVFP4QTensor(shape, dtype, weight).dequantize(scale=weight_scale, double_scale=weight_scale_2,
block_sizes={-1: 16})` and `MXFP8QTensor(...).dequantize(scale=weight_scale)`, never transformers (5.24 loads
ModelOpt's MXFP8 unscaled and does not load its NVFP4). The writer runs it, where ModelOpt is imported anyway, and
saves its output beside each export folder (`<folder>.oracle-f32.safetensors`, `<folder>.oracle-bf16.safetensors`:
each quantized weight dequantized, its input_scale left out, every other tensor as stored), cached with the export;
this module reads those files and never imports ModelOpt (that import cost some 13 s of CPU in the worker).
Compared bit for bit, as integers, so -0.0 is not 0.0:
- ModelOpt computes in float32 whatever dtype it is asked for (NVFP4: the e2m1 value times the float32 product of
  the group's float8 scale and weight_scale_2; MXFP8: the float8 value times 2^(byte - 127)) and casts the product
  once to the dtype asked: asked for float32, it gives merger's `--dtype float32` values; asked for bfloat16, the
  values merger's writer rounds once to bfloat16 by default.
- ModelOpt reads the e2m1 code 8 (-0) as +0.0, and so does merger here (compressed-tensors reads it as -0.0): the
  NVFP4 export holds such codes, counted below, and the bitwise comparison sees their sign.
The bfloat16 output must load in transformers (no missing or unexpected key) with the logits of the model built
from the oracle's state dict.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.logits import assert_logits_of
from tests.helpers.weights import assert_bitwise
from tests.writers.compressed_tensors_release import TINY

pytestmark = pytest.mark.slow

QUANTIZED = 14  # q, k, v, o, gate, up, down in each of the 2 layers; the lm_head left out by the presets


def algo_of(release: Path) -> str:
    return json.loads((release / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]


def oracle(export: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """ModelOpt's dequantization of each quantized weight of the export `export` (a folder mo_release gives) in
    `dtype`, its input_scale left out, every other tensor as stored: what the writer saved beside it."""
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    return load_file(export.with_name(f"{export.name}.oracle-{name}.safetensors"))


def minus_zero_codes(release: Path) -> int:
    """How many NVFP4 codes of the export are e2m1's -0 (code 8)."""
    state = load_file(release / "model.safetensors")
    packed = [t for n, t in state.items() if n.endswith(".weight") and t.dtype == torch.uint8]
    return sum(int(((p & 0xF) == 8).sum() + ((p >> 4) == 8).sum()) for p in packed)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_an_export_is_read_as_modelopt_dequantizes_it(fmt, mo_release, tmp_path):
    release = mo_release(fmt)
    assert algo_of(release) == fmt.upper()
    stored = load_file(release / "model.safetensors")
    assert len([n for n in stored if n.endswith(".weight_scale")]) == QUANTIZED
    if fmt == "nvfp4":
        assert minus_zero_codes(release) > 0  # ModelOpt wrote -0 codes: the comparison sees their sign

    merge_in_process(release, tmp_path / "f32", "--dtype", "float32")
    assert_bitwise(load_file(tmp_path / "f32" / "model.safetensors"), oracle(release, torch.float32), torch.float32)

    out = merge_in_process(release, tmp_path / "bf16")
    expected = oracle(release, torch.bfloat16)
    assert_bitwise(load_file(out / "model.safetensors"), expected, torch.bfloat16)
    assert not any(name.endswith("_scale") or "_scale_" in name for name in expected)  # input_scale left out
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (release / "hf_quant_config.json").is_file() and not (out / "hf_quant_config.json").exists()

    assert_logits_of(out, expected, torch.arange(TINY["vocab_size"]).reshape(4, -1))


def test_inspect_names_the_algorithm_and_what_is_left_out(mo_release, capsys):
    """What a merge would do, from metadata: the algorithm, the weights it dequantizes, what it leaves out."""
    release = mo_release("nvfp4")
    inputs = len([n for n in load_file(release / "model.safetensors") if n.endswith(".input_scale")])
    out = stdout_in_process(capsys, "inspect", "--local_dir", release)
    assert (f"note: ModelOpt NVFP4 weights (groups of 16), {QUANTIZED} tensors dequantized from their weight with "
            f"weight_scale and weight_scale_2, which are not written; {inputs} input_scale (calibration, no weight) left "
            "out; quantization_config left out of config.json, hf_quant_config.json "
            "not copied") in out


def test_an_fp8_kv_cache_scales_are_left_out(mo_release, tmp_path, capsys):
    """The NVFP4 preset with ModelOpt's FP8 KV cache: the attention's `k_scale` and `v_scale` calibrate the cache,
    no weight; merger leaves them out (named in the note) and reads the weights as without them."""
    release = mo_release("nvfp4", "fp8")
    described = json.loads((release / "hf_quant_config.json").read_text())["quantization"]
    assert described["kv_cache_quant_algo"] == "FP8"
    kv = [n for n in load_file(release / "model.safetensors") if n.rsplit(".", 1)[-1] in ("k_scale", "v_scale")]
    assert len(kv) == 2 * TINY["num_hidden_layers"]
    note = stdout_in_process(capsys, "inspect", "--local_dir", release)
    assert f"{len(kv) // 2} k_scale, {len(kv) // 2} v_scale (calibration, no weight)" in note
    out = merge_in_process(release, tmp_path / "out")
    expected = {n: t for n, t in oracle(release, torch.bfloat16).items() if n not in kv}
    assert_bitwise(load_file(out / "model.safetensors"), expected, torch.bfloat16)


def test_an_export_described_by_config_json_alone_is_read(mo_release, tmp_path):
    """Without hf_quant_config.json, config.json's quantization_config (quant_method modelopt) says the same."""
    release = Path(shutil.copytree(mo_release("mxfp8"), tmp_path / "export"))
    (release / "hf_quant_config.json").unlink()
    out = merge_in_process(release, tmp_path / "out")
    # the writer's oracle reads the export as MXFP8, the algorithm it was asked for and that config.json says
    assert json.loads((release / "config.json").read_text())["quantization_config"]["quant_algo"] == "MXFP8"
    assert_bitwise(load_file(out / "model.safetensors"), oracle(mo_release("mxfp8"), torch.bfloat16), torch.bfloat16)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
