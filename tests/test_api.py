"""The Python API (merger.merge / inspect / verify) against the same oracles as the CLI: the model's own weights
(save_pretrained's output); in this process, and inside a training script's own process group under torchrun."""
from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import merger
from tests.helpers.paths import HELPERS
from tests.helpers.processes import run, torchrun_cmd
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow


def _process_state():
    return (logging.getLogger().handlers[:], logging.getLogger("merger").handlers[:],
            signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), torch.get_num_threads())


def test_merge_returns_the_summary_and_leaves_the_process_as_found(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=2)
    before = _process_state()
    summary = merger.merge(local_dir=actor, target_dir=tmp_path / "out", dtype="bf16", max_shard_size="50KB")
    assert _process_state() == before
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert summary["status"] == "ok" and summary["dtype"] == "bfloat16" and summary["merge_world_size"] == 1
    written = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert sorted(f["name"] for f in summary["output_files"]) == written and len(written) > 1


@pytest.mark.parametrize("call, line", [
    (lambda tmp: merger.merge(local_dir=tmp / "missing", target_dir=tmp / "out"),
     "checkpoint folder does not exist, {tmp}/missing"),
    (lambda tmp: merger.merge(local_dir=tmp, target_dir=tmp / "out", dtyp="bf16"),
     "unknown option dtyp (did you mean dtype?)"),
    (lambda tmp: merger.merge(local_dir=tmp, target_dir=tmp / "out", dtype="fp8"),
     "argument --dtype: 'fp8' is a quantized format, not a dtype to cast to: --quantize fp8-block writes it with its "
     "scales (or --quantize_like RELEASE, in a release's layout)"),
    (lambda tmp: merger.merge(local_dir=tmp, target_dir=tmp / "out", summary_json="s3://bucket/summary.json"),
     "argument --summary_json/--summary-json: s3:// paths are not supported here: this flag takes a local folder, or "
     "one of a mounted bucket (e.g. s3fs, gcsfuse, blobfuse2); --local_dir, --hf_model_config_path, --base_model, "
     "--adapter, --adapter_config and --quantize_like read buckets directly, and --target_dir writes to a bucket too, "
     "s3://bucket/summary.json"),
])
def test_bad_input_raises_the_clis_line(tmp_path, call, line):
    before = _process_state()
    with pytest.raises(merger.MergerError) as raised:
        call(tmp_path)
    assert str(raised.value) == line.format(tmp=tmp_path)
    assert _process_state() == before and not (tmp_path / "out").exists()


def test_inspect_and_verify(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=2)
    weights = load_file(reference / "model.safetensors")
    info = merger.inspect(actor, merge_ranks=2)
    assert info["format"] == "fsdp" and info["source_files"] == 2 and info["output_tensors"] == len(weights)
    assert len(info["bytes_per_rank"]) == 2
    assert merger.verify(actor, reference)["ok"] is True
    changed = Path(tmp_path / "changed")
    changed.mkdir()
    for f in reference.iterdir():
        if f.name != "model.safetensors":
            (changed / f.name).write_bytes(f.read_bytes())
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name] + 1}, changed / "model.safetensors", metadata={"format": "pt"})
    result = merger.verify(actor, changed)
    assert result["ok"] is False and result["differ"] == 1


def test_merge_inside_a_training_scripts_process_group(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=2)
    proc = run(torchrun_cmd(2) + [str(HELPERS / "api_in_trainer.py"), str(actor), str(tmp_path / "out")])
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    missing = f"rank 0: checkpoint folder does not exist, {actor}-missing"  # every rank learns rank 0's error
    assert reports == [{"rank": r, "status": "ok", "world": 2, "raised": missing, "group_sum": 2.0, "unchanged": True}
                       for r in range(2)], proc.stderr[-3000:]
    assert_same_weights(tmp_path / "out", reference, torch.float32)


QUIET_MERGE = """
import logging, sys
import merger
if sys.argv[3] == "info":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
merger.merge(local_dir=sys.argv[1], target_dir=sys.argv[2])
"""


@pytest.mark.parametrize("logging_on", [False, True])
def test_a_library_call_says_nothing_unless_logging_asks(logging_on, fsdp_checkpoint, tmp_path):
    """merger.merge inside a trainer that configured no logging writes nothing to stderr, progress included; one
    whose logging shows INFO gets merger's lines and its progress, as the command line does."""
    actor, _ = fsdp_checkpoint("llama", world=2)
    proc = run([sys.executable, "-c", QUIET_MERGE, str(actor), str(tmp_path / "out"), "info" if logging_on else "-"])
    assert (tmp_path / "out" / "model.safetensors").is_file()
    if logging_on:
        assert "merger: writing 100%" in proc.stderr and "merger: wrote " in proc.stderr, proc.stderr
    else:
        assert proc.stderr == "", proc.stderr
