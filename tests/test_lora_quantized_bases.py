"""A PEFT LoRA folded into a quantized release of 2026's formats (compressed-tensors NVFP4, INT4 `pack-quantized`,
MXFP4, MXFP8; ModelOpt NVFP4, MXFP8) as `merger lora --base_model RELEASE`: dequantized, folded, and written back in
the release's layout (`--dtype keep`, the default) or as a plain model (#49 item 5).

Releases, adapter and oracles are written by tests/writers/quantized_lora_bases.py (one process, cached: ModelOpt's
import costs some 15 s of CPU), by the producing libraries and PEFT, none of it merger's code:
- PEFT's `merge_and_unload` of the adapter into the release as its library dequantizes it in float32;
- that merged model quantized by the library's own quantizer with the release's sharing rule (compressed-tensors'
  global scale across q/k/v and gate/up, ModelOpt's weight_scale_2 likewise): the bytes of each weight the adapter
  changed, and of each weight sharing a scale with one it changed where that scale then differs;
- the release's own bytes for every other tensor.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from merger.cli import main
from tests.helpers.processes import run_writer
from tests.helpers.release_bytes import same_bytes
from tests.helpers.weights import load_safetensors_folder
from tests.writers.quantized_lora_bases import CASES, FUSED, TARGETS

pytestmark = pytest.mark.slow

SHARED = {"ct-nvfp4": ".weight_global_scale", "mo-nvfp4": ".weight_scale_2"}  # the scale a fused set shares
HF_QUANT_CONFIG = "hf_quant_config.json"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_quantized_bases")
    run_writer("quantized_lora_bases.py", "--out", root)
    return root


def redone(case: str, modules: list[str], stored: dict, tool: dict) -> set[str]:
    """The quantized modules the tool's bytes are expected for: those the adapter targets, and the members of a
    fused set that shares a scale with one of them where the tool's scale of the merged set is not the release's."""
    adapted = {m for m in modules if m.rsplit(".", 1)[-1] in TARGETS}
    out = set(adapted)
    if case in SHARED:
        for m in modules:
            parent, _, leaf = m.rpartition(".")
            fused = next((names for names in FUSED if leaf in names), ())
            members = {f"{parent}.{name}" for name in fused}
            if members & adapted and not same_bytes(tool[m + SHARED[case]], stored[m + SHARED[case]]):
                out.add(m)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_lora_folded_into_a_quantized_base_is_peft_merge_then_the_tool_s_quantizer(written, case, tmp_path, capsys):
    release, adapter = written / case / "release", written / "adapter"
    stored, tool = load_safetensors_folder(release), load_file(written / case / "tool.safetensors")
    merged = load_file(written / case / "peft-merged.safetensors")

    assert main(["lora", "--base_model", str(release), "--adapter", str(adapter), "--target_dir",
                 str(tmp_path / "keep")]) == 0
    got = load_safetensors_folder(tmp_path / "keep")
    assert sorted(got) == sorted(stored)
    modules = [n.removesuffix(".weight_scale") for n in stored if n.endswith(".weight_scale")]
    assert len(modules) == 14
    expected = redone(case, modules, stored, tool)
    assert len(expected) >= 8  # q, o, gate, down of both layers
    for name, t in stored.items():
        module = name.rpartition(".")[0]
        want = tool[name] if module in expected and name in tool else t
        assert same_bytes(got[name], want), name
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "keep", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    if (release / HF_QUANT_CONFIG).is_file():
        assert (tmp_path / "keep" / HF_QUANT_CONFIG).read_text() == (release / HF_QUANT_CONFIG).read_text()

    # --dtype bfloat16: PEFT's merge as a plain model, one rounding
    assert main(["lora", "--base_model", str(release), "--adapter", str(adapter), "--target_dir",
                 str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    got = load_safetensors_folder(tmp_path / "bf16")
    assert sorted(got) == sorted(merged)
    for name, t in merged.items():
        assert same_bytes(got[name], t.to(torch.bfloat16)), name
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert not (tmp_path / "bf16" / HF_QUANT_CONFIG).exists()
    capsys.readouterr()
