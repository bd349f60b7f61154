"""`--quantize_like` a compressed-tensors `mxfp8-quantized` release: the output in the release's layout, every byte of
it where training changed nothing, and compressed-tensors' own bytes where it did (#49 items 2 and 3).

The releases are written by compressed-tensors itself (tests/writers/compressed_tensors_release.py: its
`compute_dynamic_scales_and_zp` and `ModelCompressor` on a tiny bfloat16 Llama, as llmcompressor saves MXFP8A16).
Oracles, none of them merger's code: the release's own bytes for what training left alone, and the release
compressed-tensors writes of the trained model for what it changed. compressed-tensors' rule is not a fixed point
on its own output (it rounds a group's amax to a power of two with FP4's one mantissa bit): the tests check that
premise too.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.release_bytes import bits, trained, written_back_like
from tests.helpers.weights import load_safetensors_folder
from tests.writers.compressed_tensors_release import write_release

FORMAT = "mxfp8-quantized"
SCALE = "_scale"
GROUP = 32


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(the release, the model merger reads from it: bfloat16)."""
    root = tmp_path_factory.mktemp("ct_mxfp8")
    release = write_release(root / "release", FORMAT)
    return release, merge_in_process(release, root / "bf16")


def quantized_names(state: dict) -> list[str]:
    return [n for n in state if n + SCALE in state]


def compressed_tensors_of(weights: dict, folder) -> dict[str, torch.Tensor]:
    """What compressed-tensors writes for a model of these weights (bfloat16, every tensor of the model)."""
    return load_safetensors_folder(write_release(folder, FORMAT, weights=weights))


def groups(t: torch.Tensor) -> torch.Tensor:
    return bits(t).unflatten(-1, (-1, GROUP))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_release_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys, dtype):
    release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", dtype)
    assert len(quantized_names(stored)) == 14
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "back", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    # the premise: compressed-tensors itself, on the values read back, writes other bytes somewhere
    again = compressed_tensors_of(load_safetensors_folder(bf16), tmp_path / "again")
    assert any(not torch.equal(again[n + SCALE], stored[n + SCALE]) for n in quantized_names(stored))
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert (f"14 tensors written as compressed-tensors MXFP8 like {release} (float8_e4m3fn weight, uint8 (e8m0) "
            f"weight_scale per 32 elements); quantization_config copied into config.json") in notes


def test_after_training_unchanged_groups_keep_their_bytes_and_changed_ones_are_compressed_tensors(plain, tmp_path):
    """Training changed every weight of layer 0 and one element of a weight of layer 1 in a row whose other groups
    include one that compressed-tensors would write otherwise: layer 0's weights are compressed-tensors' bytes, that
    weight's changed group is compressed-tensors' and its other groups the release's, every other tensor the
    release's bytes."""
    release, bf16 = plain
    stored, merged = load_safetensors_folder(release), load_safetensors_folder(bf16)
    again = compressed_tensors_of(merged, tmp_path / "again")
    partly, row, kept_group = next((n, int(r), int(g)) for n in quantized_names(stored) if n.startswith("model.layers.1.")
                                   for r, g in (again[n + SCALE] != stored[n + SCALE]).nonzero()[:1])
    changed_group = (kept_group + 1) % (merged[partly].shape[-1] // GROUP)
    whole = [n for n in quantized_names(stored) if n.startswith("model.layers.0.")]
    assert len(whole) == 7
    source, weights = trained(bf16, whole, partly, (row, changed_group * GROUP + 3), tmp_path / "trained")
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release))
    want = compressed_tensors_of(weights, tmp_path / "want")

    assert sorted(got) == sorted(stored)
    for name in whole:
        assert torch.equal(bits(got[name]), bits(want[name])) and torch.equal(got[name + SCALE], want[name + SCALE])
    changed = torch.zeros(stored[partly + SCALE].shape, dtype=torch.bool)
    changed[row, changed_group] = True
    assert torch.equal(groups(got[partly])[changed], groups(want[partly])[changed])
    assert torch.equal(got[partly + SCALE][changed], want[partly + SCALE][changed])
    assert torch.equal(groups(got[partly])[~changed], groups(stored[partly])[~changed])
    assert torch.equal(got[partly + SCALE][~changed], stored[partly + SCALE][~changed])
    assert want[partly + SCALE][row, kept_group] != got[partly + SCALE][row, kept_group]  # kept, not redone
    for name in set(stored) - {*whole, *(n + SCALE for n in whole), partly, partly + SCALE}:
        assert got[name].dtype == stored[name].dtype and torch.equal(bits(got[name]), bits(stored[name])), name
