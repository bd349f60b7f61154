"""`--quantize_like` a ModelOpt MXFP8 export: the output in the export's layout (its `hf_quant_config.json` too), every
byte of it where training changed nothing (#49 items 2 and 3).

The export is written by ModelOpt itself on CPU (tests/writers/modelopt_release.py through conftest's cached
`mo_release`: `mtq.quantize` with `MXFP8_DEFAULT_CFG`, `export_hf_checkpoint`). Oracles, none of them merger's code:
the export's own bytes for what training left alone; for what it changed, transformers' `Fp8Quantize` in blocks of
1x32 with ue8m0 scales, which FORMATS.md found to write ModelOpt's `MXFP8QTensor.quantize` bytes (32 of 32 tensors)
and which here is imported at no cost (ModelOpt's import takes some 15 s of CPU; the writer pays it once).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tests.helpers.in_process import merge_here, merge_in_process, stdout_in_process
from tests.helpers.release_bytes import bits, trained, written_back_like
from tests.helpers.weights import load_safetensors_folder
from tests.writers.mxfp8_release import transformers_quantized

SCALE = "_scale"
GROUP = 32
HF_QUANT_CONFIG = "hf_quant_config.json"


def mx_config() -> transformers.FineGrainedFP8Config:
    return transformers.FineGrainedFP8Config(weight_block_size=[1, GROUP], scale_fmt="ue8m0")


@pytest.fixture(scope="module")
def plain(mo_release, tmp_path_factory):
    """(the export, the model merger reads from it: bfloat16)."""
    release = mo_release("mxfp8")
    return release, merge_in_process(release, tmp_path_factory.mktemp("mo_mxfp8") / "bf16")


def quantized_names(state: dict) -> list[str]:
    return [n for n in state if n + SCALE in state]


def groups(t: torch.Tensor) -> torch.Tensor:
    return bits(t).unflatten(-1, (-1, GROUP))


def test_export_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys):
    release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", "bfloat16")
    assert len(quantized_names(stored)) == 14
    assert (tmp_path / "back" / HF_QUANT_CONFIG).read_text() == (release / HF_QUANT_CONFIG).read_text()
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "back", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    # the premise: the rule, on the values read back, writes other bytes somewhere
    merged = load_safetensors_folder(bf16)
    assert any(not torch.equal(transformers_quantized(n, merged[n], mx_config())[1], stored[n + SCALE])
               for n in quantized_names(stored))
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert (f"14 tensors written as ModelOpt MXFP8 like {release} (float8_e4m3fn weight, uint8 (e8m0) weight_scale "
            f"per 32 elements); quantization_config copied into config.json, {HF_QUANT_CONFIG} beside it") in notes


def test_after_training_unchanged_groups_keep_their_bytes_and_changed_ones_are_the_rule_s(plain, tmp_path):
    """Training changed every weight of layer 1 and one element of a weight of layer 0 in a row whose other groups
    include one the rule would write otherwise."""
    release, bf16 = plain
    stored, merged = load_safetensors_folder(release), load_safetensors_folder(bf16)
    redone = {n: transformers_quantized(n, merged[n], mx_config()) for n in quantized_names(stored)}
    partly, row, kept_group = next((n, int(r), int(g)) for n in quantized_names(stored) if n.startswith("model.layers.0.")
                                   for r, g in (redone[n][1] != stored[n + SCALE]).nonzero()[:1])
    changed_group = (kept_group + 1) % (merged[partly].shape[-1] // GROUP)
    whole = [n for n in quantized_names(stored) if n.startswith("model.layers.1.")]
    assert len(whole) == 7
    source, weights = trained(bf16, whole, partly, (row, changed_group * GROUP + 3), tmp_path / "trained")
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release,
                                                  "--verify"))

    assert sorted(got) == sorted(stored)
    for name in whole:
        codes, scale = transformers_quantized(name, weights[name], mx_config())
        assert torch.equal(bits(got[name]), bits(codes)) and torch.equal(got[name + SCALE], scale), name
    codes, scale = transformers_quantized(partly, weights[partly], mx_config())
    changed = torch.zeros(stored[partly + SCALE].shape, dtype=torch.bool)
    changed[row, changed_group] = True
    assert torch.equal(groups(got[partly])[changed], groups(codes)[changed])
    assert torch.equal(got[partly + SCALE][changed], scale[changed])
    assert torch.equal(groups(got[partly])[~changed], groups(stored[partly])[~changed])
    assert torch.equal(got[partly + SCALE][~changed], stored[partly + SCALE][~changed])
    assert scale[row, kept_group] != got[partly + SCALE][row, kept_group]  # kept, not redone
    for name in set(stored) - {*whole, *(n + SCALE for n in whole), partly, partly + SCALE}:
        assert got[name].dtype == stored[name].dtype and torch.equal(bits(got[name]), bits(stored[name])), name


def test_an_export_with_a_quantized_kv_cache_is_refused(plain, tmp_path, capsys):
    """Its k_scale and v_scale calibrate the cache on data: nothing to write them from."""
    release, bf16 = plain
    folder = shutil.copytree(release, tmp_path / "release")
    described = json.loads((folder / HF_QUANT_CONFIG).read_text())
    described["quantization"]["kv_cache_quant_algo"] = "FP8"
    (folder / HF_QUANT_CONFIG).write_text(json.dumps(described))
    code, errors = merge_here(capsys, "--local_dir", bf16, "--target_dir", tmp_path / "out", "--quantize_like", folder)
    assert code == 1 and errors == [
        f"merger: error: ModelOpt MXFP8 with its KV cache quantized (FP8) as --quantize_like's release: its k_scale "
        f"and v_scale calibrate the cache on data merger does not have, and merger writes such an export only "
        f"without them, {folder / HF_QUANT_CONFIG}"], errors
    assert not (tmp_path / "out").exists()
