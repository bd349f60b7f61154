"""gpt-oss (HF gpt_oss) and MiniMax-M2 (HF minimax_m2) Megatron checkpoints merged to HF, checked against
Megatron's own forward pass.

megatron-core 0.16.1 writes each model at TP 2 and EP 2 (expert TP 1, as gpt-oss's expert biases need), legacy
and torch_dist (tests/writers/megatron_gpt_oss_minimax.py, one torchrun launch of 2 gloo ranks):
- gpt-oss: attention with biases and learnable sinks (Megatron's `softmax_offset`, split over TP with the heads
  but not flagged as split), a 3-token sliding window on the first layer, a router with a bias, experts with
  biases and the clamped GLU, which HF keeps stacked on disk (gate_up_proj [E, hidden, 2 x inter], gate and up
  interleaved);
- MiniMax-M2: q/k norms across all heads (heads x head_dim, split over TP with the heads, unflagged too; the
  writer's own norm class sums the squares over the TP ranks as HF's one norm does), partial rotary, a sigmoid
  router whose expert bias steers the choice, per-expert w1/w2/w3.
The writer draws every TP half of the sinks and norms apart, so a merge taking one rank's half as the whole, or
one rank's half twice, moves the logits by 0.03 to 0.1. Oracles: Megatron's CPU logits against transformers'
forward of the merged folder (fp32, max abs diff < 1e-4, the same argmax); the names and shapes transformers'
save_pretrained writes for the same config; legacy and torch_dist merge to the same bytes, as do one and two
merge ranks; transformers' MXFP4 dequantizer on `--quantize mxfp4`'s experts.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.expert_slabs import assert_stacks_written_by_expert
from tests.helpers.files import assert_same_files, block_crc32
from tests.helpers.in_process import merge_here, merge_in_process
from tests.helpers.megatron_mtp_models import (assert_loads_with_megatron_logits, merged_once, oracle,
                                               saved_by_transformers, write_cases)
from tests.helpers.processes import run_merger, start_merger
from tests.helpers.reliability import wait_paused
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASES = {
    "gpt_oss_tp2_ep2": "arch=gpt_oss",
    "minimax_m2_tp2_ep2": "arch=minimax_m2",
}
# One query and one key-value head per TP rank: a legacy file's full-width norms are as wide as one head's would be
MHA = "minimax_m2_mha_tp2"


@pytest.fixture(scope="session")
def frontier_root(tmp_path_factory) -> Path:
    return write_cases(tmp_path_factory, "megatron_gpt_oss_minimax", {**CASES, MHA: "arch=minimax_m2,heads=2,groups=2"},
                       writer="megatron_gpt_oss_minimax.py")


@pytest.fixture(scope="session")
def merged(frontier_root, tmp_path_factory):
    return merged_once(frontier_root, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_reproduces_megatron_logits(case, frontier_root, merged):
    assert_loads_with_megatron_logits(merged(case, "legacy"), oracle(frontier_root, case))


@pytest.mark.parametrize("case", list(CASES))
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_shapes_are_those_save_pretrained_writes(case, frontier_root, merged, tmp_path):
    own = {n: t.shape for n, t in saved_by_transformers(frontier_root / case / "hf", tmp_path / "own").items()}
    assert {n: t.shape for n, t in load_safetensors_folder(merged(case, "legacy")).items()} == own


def test_full_width_norms_a_legacy_file_cannot_tell_from_one_heads_are_refused(frontier_root, merged, tmp_path,
                                                                                capsys):
    """With one query and one key-value head per rank, a legacy file's norms fit both readings; read as one head's,
    config.json's width refuses them, naming the tensor (nothing written). torch_dist records the split."""
    code, errors = merge_here(capsys, "--local_dir", frontier_root / MHA / "legacy", "--target_dir", tmp_path / "hf",
                              "--hf_model_config_path", frontier_root / MHA / "hf")
    assert code != 0 and len(errors) == 1 and not (tmp_path / "hf").exists()
    assert "q_layernorm.weight has 16 rows where config.json needs 32 for model.layers.0.self_attn.q_norm" in errors[0]
    assert_loads_with_megatron_logits(merged(MHA, "dist"), oracle(frontier_root, MHA))


def test_a_config_with_other_experts_than_the_checkpoint_is_one_error_line(frontier_root, tmp_path, capsys):
    case = "gpt_oss_tp2_ep2"
    hf = tmp_path / "config"
    shutil.copytree(frontier_root / case / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, num_local_experts=8)))
    code, errors = merge_here(capsys, "--local_dir", frontier_root / case / "dist", "--target_dir", tmp_path / "hf",
                              "--hf_model_config_path", hf)
    assert code != 0 and not (tmp_path / "hf").exists()
    assert len(errors) == 1 and re.fullmatch(
        r"merger: error: model\.layers\.0\.mlp\.experts\.\w+ stacks config\.json's 8 experts \(num_local_experts\), "
        r"but the checkpoint holds experts \[0, 1, 2, 3\], " + re.escape(str(frontier_root / case / "dist")), errors[0])


def test_two_merge_ranks_write_what_one_does(frontier_root, merged, tmp_path):
    """A stacked expert tensor's inputs lie in both EP ranks' files, which the two merge ranks read apart: the
    writer gathers them, and the files hold what one process writes."""
    case = "gpt_oss_tp2_ep2"
    run_merger("merge", "--local_dir", frontier_root / case / "legacy", "--target_dir", tmp_path / "hf",
               "--hf_model_config_path", frontier_root / case / "hf", "--dtype", "float32", nproc=2)
    assert_same_weights(tmp_path / "hf", merged(case, "legacy"), None)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_no_step_holds_a_whole_expert_stack(frontier_root, fmt):
    """HF keeps gpt-oss's experts stacked [E, ...] in one tensor: each is written an expert a step (its slab, rows
    [e, e + 1)), so the writer of a step holds one expert's input and output, never the stack."""
    case = "gpt_oss_tp2_ep2"
    assert_stacks_written_by_expert(frontier_root / case / fmt, frontier_root / case / "hf")


def test_gpt_oss_experts_quantize_to_mxfp4_as_the_release_stores_them(frontier_root, merged, tmp_path):
    """`--quantize mxfp4` on the Megatron checkpoint: each stacked expert tensor becomes the release's _blocks and
    _scales, which transformers' own CPU dequantizer reads back within MXFP4's rounding of the float merge (at most
    one block scale 2^(scale - 127) off); every other tensor is the float merge's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    case = "gpt_oss_tp2_ep2"
    out = merge_in_process(frontier_root / case / "dist", tmp_path / "mx", "--hf_model_config_path",
                           frontier_root / case / "hf", "--dtype", "float32", "--quantize", "mxfp4")
    got, floats = load_safetensors_folder(out), load_safetensors_folder(merged(case, "legacy"))
    quantized = sorted(n for n in floats if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert len(quantized) == 4
    assert set(got) == (set(floats) - set(quantized)) | {n + s for n in quantized for s in ("_blocks", "_scales")}
    for name in quantized:
        back = convert_moe_packed_tensors(got[name + "_blocks"], got[name + "_scales"], dtype=torch.float32)
        scale = (2.0 ** (got[name + "_scales"].double() - 127)).float().repeat_interleave(32, -1).transpose(1, 2)
        assert back.shape == floats[name].shape and ((back - floats[name]).abs() <= scale).all(), name
    assert all(torch.equal(got[n], floats[n]) for n in set(floats) - set(quantized))


def test_an_interrupted_merge_of_stacked_experts_resumes_to_the_same_bytes(frontier_root, tmp_path):
    """gpt-oss's stacks are written by several steps (an expert's slab each), so a stack is finished only with its
    last slab: Ctrl-C part way, then --resume, writes the files of one uninterrupted merge, byte for byte, and the
    manifest's block checksums are those of the bytes on disk."""
    case = "gpt_oss_tp2_ep2"
    flags = ("--hf_model_config_path", frontier_root / case / "hf", "--dtype", "float32",
             "--max_shard_size", "60KB", "--max_inflight", "1")
    src, out, stage, pause = frontier_root / case / "legacy", tmp_path / "out", tmp_path / ".out.merger-partial", \
        tmp_path / "paused"
    proc = start_merger("merge", "--local_dir", src, "--target_dir", out, *flags,
                        env={"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)})
    wait_paused([proc], pause, [0])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stage.is_dir() and not out.exists(), err
    kept = json.loads((stage / "merge_manifest.json").read_text())["output_files"]
    assert 0 < sum(all(f["crc32_blocks"]) for f in kept.values()) < len(kept)  # some files finished, not all

    resumed = run_merger("merge", "--local_dir", src, "--target_dir", out, *flags, "--resume")
    assert "reusing" in resumed.stderr
    assert_same_files(out, merge_in_process(src, tmp_path / "whole", *flags))
    final = json.loads((out / "merge_manifest.json").read_text())
    for name, info in final["output_files"].items():
        assert info["crc32_blocks"] == block_crc32(out / name, final["checksum_block_bytes"]), name


def test_fp8_for_experts_with_biases_is_one_error_line(frontier_root, tmp_path):
    """transformers' FP8 experts take no biases, and gpt-oss's have them: `--quantize fp8-block` stops with one line
    saying so (transformers could not load such an output), not an internal error, and writes nothing."""
    case = "gpt_oss_tp2_ep2"
    proc = run_merger("merge", "--local_dir", frontier_root / case / "legacy", "--target_dir", tmp_path / "out",
                      "--hf_model_config_path", frontier_root / case / "hf", "--quantize", "fp8-block", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.fullmatch(r"merger: error: --quantize fp8-block: transformers [\d.]+\S* cannot make this model FP8 "
                        r"\(model_type 'gpt_oss': .*bias.*\), so it could not load the output either; merge without "
                        r"--quantize, " + re.escape(str(frontier_root / case / "hf" / "config.json")), errors[0])
    assert not (tmp_path / "out").exists()
