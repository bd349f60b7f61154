"""`--quantize_like` a ModelOpt NVFP4 export: the output in the export's layout (its `hf_quant_config.json` and the
activations' `input_scale` too), every byte of it where training changed nothing, and ModelOpt's own bytes where it
did, `weight_scale_2` shared within q/k/v and within gate/up as the export shares it (#49 items 2 and 3).

The export is written by ModelOpt itself on CPU (tests/writers/modelopt_release.py through conftest's cached
`mo_release`: `mtq.quantize` with `NVFP4_DEFAULT_CFG`, `export_hf_checkpoint`). So is the oracle of a trained model:
the writer takes ModelOpt's own bfloat16 dequantization of the export (what merger reads from it, bit for bit:
test_modelopt_read.py), changes it as `trained` says, saves those weights and exports them with ModelOpt again
(`<export>.trained.safetensors`, `<export>.trained/`), so the test process never imports ModelOpt (some 15 s of CPU).
Oracles, none of them merger's code: the export's own bytes for what training left alone, ModelOpt's export of the
trained model for what it changed. ModelOpt's rule is no fixed point on its own output: it writes a negative weight
that rounds to 0 as -0 (code 8), which its reader takes as +0; the test checks the export has such codes.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.release_bytes import (assert_only_changed_groups_redone, groups_differ, same_bytes,
                                        written_back_like)
from tests.helpers.weights import load_safetensors_folder

HF_QUANT_CONFIG = "hf_quant_config.json"
CODES, SCALE, SCALE_2, INPUT_SCALE = ".weight", ".weight_scale", ".weight_scale_2", ".input_scale"
GROUP = 16


@pytest.fixture(scope="module")
def plain(mo_release, tmp_path_factory):
    """(the export, the model merger reads from it: bfloat16)."""
    release = mo_release("nvfp4")
    return release, merge_in_process(release, tmp_path_factory.mktemp("mo_nvfp4") / "bf16")


def modules(state: dict) -> list[str]:
    return [n.removesuffix(SCALE) for n in state if n.endswith(SCALE)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys, dtype):
    release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", dtype)
    assert len(modules(stored)) == 14
    assert (tmp_path / "back" / HF_QUANT_CONFIG).read_text() == (release / HF_QUANT_CONFIG).read_text()
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "back", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    # the export shares weight_scale_2 within q/k/v and within gate/up
    layer = "model.layers.0."
    assert all(same_bytes(stored[f"{layer}self_attn.{p}_proj{SCALE_2}"], stored[f"{layer}self_attn.q_proj{SCALE_2}"])
               for p in "kv")
    assert same_bytes(stored[f"{layer}mlp.up_proj{SCALE_2}"], stored[f"{layer}mlp.gate_proj{SCALE_2}"])
    # the premise: ModelOpt wrote -0 codes, which read back as +0 and no rule on the values writes again
    packed = torch.cat([stored[m + CODES].reshape(-1) for m in modules(stored)])
    assert bool(((packed & 0xF) == 8).any() | ((packed >> 4) == 8).any())
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert (f"14 tensors written as ModelOpt NVFP4 like {release} (uint8 weight of 2 e2m1 codes, float8_e4m3fn "
            f"weight_scale per 16 elements, float32 weight_scale_2, float32 input_scale the release's); "
            f"quantization_config copied into config.json, {HF_QUANT_CONFIG} beside it") in notes


def test_after_training_unchanged_tensors_keep_their_bytes_and_changed_ones_are_modelopts(plain, tmp_path):
    """Training (the writer's `trained`) changed every weight of layer 0, one element of layer 1's q_proj (not its
    largest: q/k/v's weight_scale_2 stays, as ModelOpt computes it again) and the largest element of layer 1's
    gate_proj (gate/up's weight_scale_2 cannot stay). Layer 0 is ModelOpt's bytes; q_proj's changed group is
    ModelOpt's and its other groups, k_proj and v_proj the export's; gate_proj and up_proj are ModelOpt's whole,
    up_proj requantized with the new weight_scale_2 although training left it alone. Every other tensor is the
    export's bytes, the activations' input_scale included (ModelOpt's export of the trained model calibrated its
    own, on data merger does not have)."""
    release, bf16 = plain
    stored = load_safetensors_folder(release)
    source = shutil.copytree(bf16, tmp_path / "trained")
    shutil.copy(release.with_name(f"{release.name}.trained.safetensors"), source / "model.safetensors")
    weights = load_safetensors_folder(source)
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release,
                                                  "--verify"))
    want = load_safetensors_folder(release.with_name(f"{release.name}.trained"))
    assert sorted(got) == sorted(stored)

    q, gate = "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.gate_proj"
    up = gate.replace("gate", "up")
    redone = [m for m in modules(stored) if m.startswith("model.layers.0.")] + [gate, up]
    assert len(redone) == 9
    for name in (m + part for m in redone for part in (CODES, SCALE, SCALE_2)):
        assert same_bytes(got[name], want[name]), name
    assert not same_bytes(want[gate + SCALE_2], stored[gate + SCALE_2])  # the premise: it had to change
    assert groups_differ(up, (CODES, SCALE), want, stored).any()  # up_proj, unchanged, is not the export's bytes

    # q_proj: its weight_scale_2 stays, so only the changed group is ModelOpt's
    assert same_bytes(want[q + SCALE_2], stored[q + SCALE_2]) and same_bytes(got[q + SCALE_2], stored[q + SCALE_2])
    assert_only_changed_groups_redone(q, (CODES, SCALE), load_safetensors_folder(bf16)[q + ".weight"],
                                      weights[q + ".weight"], got, want, stored, GROUP)

    written = {m + part for m in (*redone, q) for part in (CODES, SCALE, SCALE_2)}
    for name in set(stored) - written:
        assert same_bytes(got[name], stored[name]), name
    assert any(not same_bytes(want[n], stored[n]) for n in stored if n.endswith(INPUT_SCALE))  # recalibrated there
