"""`--quantize_like` a compressed-tensors release in `mxfp8-quantized`, INT4 `pack-quantized` or
`mxfp4-pack-quantized`: the output in the release's layout, every byte of it where training changed nothing, and
compressed-tensors' own bytes where it did (#49 items 2 and 3).

The releases are written by compressed-tensors itself (tests/writers/compressed_tensors_release.py: its
`compute_dynamic_scales_and_zp` and `ModelCompressor` on a tiny bfloat16 Llama, as llmcompressor saves MXFP8A16,
MXFP4A16 and Kimi-K2's INT4 in groups of 32). Oracles, none of them merger's code: the release's own bytes for what
training left alone, and the release compressed-tensors writes of the trained model for what it changed.
compressed-tensors' rules are not fixed points on their own output (MXFP8 rounds a group's amax to a power of two
with FP4's one mantissa bit; INT4's scale is amax / 7.5; MXFP4 writes a -0 it reads back as +0): the tests check
that premise too.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.release_bytes import bits, trained, written_back_like
from tests.helpers.weights import load_safetensors_folder
from tests.writers.compressed_tensors_release import write_release

SCALE = ".weight_scale"
GROUP = 32
# format -> (the tensor holding a weight's codes, how the log names the format and its tensors)
FORMATS = {
    "mxfp8-quantized": (".weight", "compressed-tensors MXFP8 like {} (float8_e4m3fn weight, uint8 (e8m0) "
                                   "weight_scale per 32 elements)"),
    "pack-quantized": (".weight_packed", "compressed-tensors INT4 like {} (int32 weight_packed of 8 codes, bfloat16 "
                                         "weight_scale per 32 elements, int64 weight_shape)"),
    "mxfp4-pack-quantized": (".weight_packed", "compressed-tensors MXFP4 like {} (uint8 weight_packed of 2 e2m1 codes, "
                                               "uint8 (e8m0) weight_scale per 32 elements)"),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def plain(request, tmp_path_factory):
    """(the format, its release, the model merger reads from it: bfloat16)."""
    root = tmp_path_factory.mktemp("ct_write")
    release = write_release(root / "release", request.param)
    return request.param, release, merge_in_process(release, root / "bf16")


def modules(state: dict) -> list[str]:
    """The quantized layers: those with a weight_scale."""
    return [n.removesuffix(SCALE) for n in state if n.endswith(SCALE)]


def groups_differ(fmt: str, module: str, a: dict, b: dict) -> torch.Tensor:
    """bool [out, in / 32]: whether each group of `module`'s weight has other bytes (codes or scale) in `a` and `b`."""
    codes = [bits(s[module + FORMATS[fmt][0]]).unflatten(-1, (a[module + SCALE].shape[-1], -1)) for s in (a, b)]
    return (codes[0] != codes[1]).any(-1) | (bits(a[module + SCALE]) != bits(b[module + SCALE]))


def compressed_tensors_of(fmt: str, weights: dict, folder) -> dict[str, torch.Tensor]:
    """What compressed-tensors writes for a model of these weights (bfloat16, every tensor of the model)."""
    return load_safetensors_folder(write_release(folder, fmt, weights=weights))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_release_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys, dtype):
    fmt, release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", dtype)
    assert len(modules(stored)) == 14
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "back", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    # the premise: compressed-tensors itself, on the values read back, writes other bytes somewhere (MXFP8's and
    # INT4's scales; MXFP4's -0 codes, which it writes as +0)
    again = compressed_tensors_of(fmt, load_safetensors_folder(bf16), tmp_path / "again")
    assert any(groups_differ(fmt, m, again, stored).any() for m in modules(stored))
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert (f"14 tensors written as {FORMATS[fmt][1].format(release)}; quantization_config copied into "
            f"config.json") in notes


def test_after_training_unchanged_groups_keep_their_bytes_and_changed_ones_are_compressed_tensors(plain, tmp_path):
    """Training changed every weight of layer 0 and one element of a weight of layer 1 in a row whose other groups
    include one that compressed-tensors would write otherwise: layer 0's weights are compressed-tensors' bytes, that
    weight's changed group is compressed-tensors' and its other groups the release's, every other tensor the
    release's bytes."""
    fmt, release, bf16 = plain
    codes = FORMATS[fmt][0]
    stored, merged = load_safetensors_folder(release), load_safetensors_folder(bf16)
    again = compressed_tensors_of(fmt, merged, tmp_path / "again")
    partly, row, kept_group = next((m, int(r), int(g)) for m in modules(stored) if m.startswith("model.layers.1.")
                                   for r, g in groups_differ(fmt, m, again, stored).nonzero()[:1])
    changed_group = (kept_group + 1) % (merged[partly + ".weight"].shape[-1] // GROUP)
    whole = [m for m in modules(stored) if m.startswith("model.layers.0.")]
    assert len(whole) == 7
    source, weights = trained(bf16, [m + ".weight" for m in whole], partly + ".weight",
                              (row, changed_group * GROUP + 3), tmp_path / "trained")
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release,
                                                  "--verify"))
    want = compressed_tensors_of(fmt, weights, tmp_path / "want")

    assert sorted(got) == sorted(stored)
    written = {n for n in stored if any(n.startswith(m + ".weight") for m in (*whole, partly))}
    for name in written - {partly + codes, partly + SCALE}:
        assert got[name].dtype == want[name].dtype and torch.equal(bits(got[name]), bits(want[name])), name
    changed = torch.zeros(stored[partly + SCALE].shape, dtype=torch.bool)
    changed[row, changed_group] = True
    got_codes, want_codes, stored_codes = (s[partly + codes].unflatten(-1, (changed.shape[-1], -1))
                                           for s in (got, want, stored))
    assert torch.equal(bits(got_codes[changed]), bits(want_codes[changed]))
    assert torch.equal(bits(got[partly + SCALE][changed]), bits(want[partly + SCALE][changed]))
    assert torch.equal(bits(got_codes[~changed]), bits(stored_codes[~changed]))
    assert torch.equal(bits(got[partly + SCALE][~changed]), bits(stored[partly + SCALE][~changed]))
    assert groups_differ(fmt, partly, want, got)[row, kept_group]  # kept, not redone
    for name in set(stored) - written:
        assert got[name].dtype == stored[name].dtype and torch.equal(bits(got[name]), bits(stored[name])), name
