"""compressed-tensors releases (NVFP4, INT4 `pack-quantized` in groups of 32, MXFP4, MXFP8) merged into a plain
model: every quantized weight dequantized, every other tensor as stored, no quantization_config.

The releases are written by compressed-tensors itself (tests/writers/compressed_tensors_release.py). Oracles are
compressed-tensors' own code, compared bit for bit (-0.0 included: the MXFP4 and NVFP4 releases hold thousands):
- bfloat16 (the default --dtype): `CompressedTensorsDequantizer(release, dtype=bfloat16).process(tensors)`, the
  library's dequantizer of whole checkpoints. It computes FP4 and MX products in bfloat16, exact (a code times a
  power of two), and INT4's and NVFP4's in the scale's dtype or float32 and rounds the product to bfloat16 once;
  merger computes in float32 and the writer rounds once to bfloat16: the same bits.
- float32: the dequantizer asked for float32 returns those bfloat16 values widened for INT4 and NVFP4 (its
  decompressors round to bfloat16 before its final cast), where merger keeps the float32 product. The float32
  oracle is then compressed-tensors' arithmetic in float32: its own unpacking of the codes
  (`unpack_from_int32`, `unpack_fp4_from_uint8(dtype=float32)`), its e8m0 scales (`decompress_mx_scale`) and its
  `dequantize` of groups (quantization/lifecycle/forward.py), the scales in float32.
The name-only matcher of the dequantizer takes the embedding's `weight` for a Linear's under MXFP8's scheme (its
codes' part is `weight` too): it is told the embedding is no quantized module.
The bfloat16 output must load in transformers (no missing or unexpected key) with the logits of the model built
from the oracle's state dict, and two merge ranks write the bytes one process writes.
"""
from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers.files import snapshot
from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.logits import assert_logits_of
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_bitwise
from tests.writers.compressed_tensors_release import FORMATS, TINY, dequantized_float32

pytestmark = pytest.mark.slow

NOT_QUANTIZED = ["model.embed_tokens"]  # no Linear: what the dequantizer's name matching cannot tell


def oracle_bfloat16(release: Path) -> dict[str, torch.Tensor]:
    return CompressedTensorsDequantizer(release, ignore=NOT_QUANTIZED, dtype=torch.bfloat16).process(
        load_file(release / "model.safetensors"))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_release_is_read_as_compressed_tensors_dequantizes_it(fmt, ct_release, tmp_path):
    release = ct_release(fmt)
    merge_in_process(release, tmp_path / "f32", "--dtype", "float32")
    assert_bitwise(load_file(tmp_path / "f32" / "model.safetensors"), dequantized_float32(release), torch.float32)

    out = merge_in_process(release, tmp_path / "bf16")
    oracle = oracle_bfloat16(release)
    assert_bitwise(load_file(out / "model.safetensors"), oracle, torch.bfloat16)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    assert_logits_of(out, oracle, torch.arange(TINY["vocab_size"]).reshape(4, -1))


def test_two_ranks_write_the_bytes_one_process_writes(ct_release, tmp_path):
    """NVFP4 (the format with most parts a step reads) in output files of 100 KB, so both ranks write; every file
    but the manifest, which records the ranks."""
    release, small = ct_release("nvfp4-pack-quantized"), ("--max_shard_size", "100KB")
    merge_in_process(release, tmp_path / "one", *small)
    run_merger("merge", "--local_dir", release, "--target_dir", tmp_path / "two", *small, nproc=2)
    one, two = ({name: sha for name, (sha, _, _) in snapshot(tmp_path / out).items() if name != "merge_manifest.json"}
                for out in ("one", "two"))
    assert len([name for name in one if name.endswith(".safetensors")]) > 1 and two == one


def test_nvfp4_activation_scales_are_left_out(ct_release, tmp_path):
    """NVFP4 with activations (W4A4): each quantized layer's `input_global_scale` is the activations' calibration,
    no weight; the dequantizer copies it through (its scheme's activations are dynamic), merger leaves it out."""
    release = ct_release("nvfp4 W4A4")
    oracle = oracle_bfloat16(release)
    scales = [name for name in oracle if name.endswith(".input_global_scale")]
    assert len(scales) == 14
    out = merge_in_process(release, tmp_path / "out")
    assert_bitwise(load_file(out / "model.safetensors"), {n: t for n, t in oracle.items() if n not in scales},
                   torch.bfloat16)


def test_inspect_names_the_format(ct_release, capsys):
    """What a merge would do, from metadata: the format, the weights it dequantizes, what it leaves out."""
    out = stdout_in_process(capsys, "inspect", "--local_dir", ct_release("pack-quantized"))
    assert ("note: compressed-tensors pack-quantized weights (groups of 32), 14 tensors dequantized from their "
            "weight_packed with weight_scale and weight_shape, which are not written; quantization_config left out "
            "of config.json") in out


def test_inspect_names_what_the_release_leaves_unquantized(ct_release, capsys):
    """One line names every tensor the release stores unquantized, layers' indices as `*`. Oracle: the release's
    own files: its safetensors dtypes as the safetensors library reads them (MXFP8's parts are float8 codes and
    uint8 scales; a tensor stored in the model's dtype is unquantized) and its config's `ignore`."""
    release = ct_release("mxfp8-quantized")
    qc = json.loads((release / "config.json").read_text())["quantization_config"]
    with safe_open(release / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    plain = [name for name, dtype in dtypes.items() if dtype == "BF16"]
    assert {dtype for name, dtype in dtypes.items() if name not in plain} == {"F8_E4M3", "U8"}
    out = stdout_in_process(capsys, "inspect", "--local_dir", release).splitlines()
    assert any(f"note: compressed-tensors {qc['format']} weights (groups of "
               f"{qc['config_groups']['group_0']['weights']['group_size']})" in line for line in out)
    [line] = [line for line in out if line.startswith("note: unquantized in the release: ")]
    count, _, listed = line.removeprefix("note: unquantized in the release: ").partition(" tensors (")
    kinds = listed.removesuffix("), cast to --dtype").split(", ")
    assert int(count) == len(plain)
    assert all(sum(fnmatchcase(name, kind) for kind in kinds) == 1 for name in plain)  # each named, once
    assert all(any(fnmatchcase(name, kind) for name in plain) for kind in kinds)  # nothing else
    assert all(any(name.startswith(f"{ignored}.") for name in plain) for ignored in qc["ignore"])
