"""`--quantize_like RELEASE` gives back every byte of the release where training changed nothing (#49 item 3).

The release is DeepSeek-V3.1's format made by transformers itself (tests/writers/mxfp8_release.py
--deepseek_v3_1: its `Fp8Quantize` under `FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0")`
on a tiny bfloat16 Llama, 14 quantized weights of 4 to 6 blocks, float32 power-of-two scales). Oracles, none of
them merger's code: the release's own bytes for whatever training left alone, and transformers' `Fp8Quantize` on
the weight training changed. transformers' rule is not a fixed point on its own output (a block whose largest code
is 224 comes back with half the scale), and this release has such a block: the test checks that premise too.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.release_bytes import bits, trained, written_back_like
from tests.helpers.weights import load_safetensors_folder
from tests.writers.mxfp8_release import deepseek_v3_1_config, transformers_quantized, write_release

SCALE = "_scale_inv"
BLOCK = 128


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(the release, the model merger reads from it: bfloat16)."""
    root = tmp_path_factory.mktemp("v3_1")
    release = write_release(root / "release", deepseek_v3_1=True)
    return release, merge_in_process(release, root / "bf16")


def fp8_quantized(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize under the release's config: (float8 codes, float32 scale_inv per block)."""
    codes, scale = transformers_quantized(name, weight, deepseek_v3_1_config())
    return codes, scale.view(torch.float8_e8m0fnu).to(torch.float32)


def block_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows / 128, cols / 128, 128 * 128] the bytes of each block."""
    return bits(t).unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK)).transpose(1, 2).flatten(-2)


def requantized_blocks(stored: dict, merged: dict) -> dict[str, torch.Tensor]:
    """For each quantized weight, which of its blocks transformers' Fp8Quantize of the read-back weight does not
    give back as the release has them (codes or scale)."""
    out = {}
    for name in (n for n in stored if n + SCALE in stored):
        codes, scale = fp8_quantized(name, merged[name])
        out[name] = ((block_bytes(codes) != block_bytes(stored[name])).any(-1)
                     | (scale != stored[name + SCALE]))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_release_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys, dtype):
    release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", dtype)
    assert sum(n.endswith(SCALE) for n in stored) == 14
    # the premise: the producing tool's own quantizer, on the same values, gives other bytes somewhere
    assert any(m.any() for m in requantized_blocks(stored, load_safetensors_folder(bf16)).values())
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert ("each FP8 block whose values are the release's own keeps the release's bytes (codes and scale); every "
            "other block is quantized") in notes


def test_after_training_unchanged_blocks_keep_their_bytes_and_changed_ones_are_transformers(plain, tmp_path):
    """Training changed every weight of layer 0 and one element of a weight of layer 1 whose other blocks include
    one that transformers' rule would write otherwise: layer 0's weights are Fp8Quantize's bytes, that weight's
    changed block is Fp8Quantize's and its other blocks the release's, every other tensor the release's bytes."""
    release, bf16 = plain
    stored, merged = load_safetensors_folder(release), load_safetensors_folder(bf16)
    differs = requantized_blocks(stored, merged)
    partly = next(n for n, m in differs.items() if m.any() and n.startswith("model.layers.1."))
    untouched = tuple(int(i) for i in (~differs[partly]).nonzero()[0])  # a block the rule gives back as it was
    touched = tuple(int(i) for i in differs[partly].nonzero()[0])
    whole = [n for n in stored if n.startswith("model.layers.0.") and n + SCALE in stored]
    assert len(whole) == 7
    source, weights = trained(bf16, whole, partly, (untouched[0] * BLOCK + 5, untouched[1] * BLOCK + 7),
                              tmp_path / "trained")
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release,
                                                  "--verify"))

    assert sorted(got) == sorted(stored)
    for name in whole:
        codes, scale = fp8_quantized(name, weights[name])
        assert torch.equal(bits(got[name]), bits(codes)) and torch.equal(got[name + SCALE], scale), name
    codes, scale = fp8_quantized(partly, weights[partly])
    kept = torch.ones(scale.shape, dtype=torch.bool)
    kept[untouched] = False
    assert torch.equal(block_bytes(got[partly])[untouched], block_bytes(codes)[untouched])
    assert got[partly + SCALE][untouched] == scale[untouched]
    assert torch.equal(block_bytes(got[partly])[kept], block_bytes(stored[partly])[kept])
    assert torch.equal(got[partly + SCALE][kept], stored[partly + SCALE][kept])
    assert not torch.equal(block_bytes(codes)[touched], block_bytes(stored[partly])[touched])  # kept, not redone
    for name in set(stored) - {*whole, *(n + SCALE for n in whole), partly, partly + SCALE}:
        assert got[name].dtype == stored[name].dtype and torch.equal(bits(got[name]), bits(stored[name])), name
