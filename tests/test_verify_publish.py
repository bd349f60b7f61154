"""`merge --verify`, `merger test` with tolerances and its mismatch table, `--summary-json`, and publishing to the
Hub (huggingface_hub's HfApi replaced by a recorder: there is no network here).

One real FSDP2 checkpoint (2 ranks, fully_shard + torch.save) serves every test; the oracle is the model's own
save_pretrained output and the safetensors library's reading of our files.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from merger import cli
from merger.api.pipeline import prepare, verify_staged
from merger.engine.compare import _differences
from merger.engine.dist import Group
from merger.errors import MergerError
from merger.options import MergeOptions
from merger.output import publish
from tests.helpers.hub_recorder import RecordingHfApi, calls
from tests.helpers.paths import HELPERS
from tests.helpers.processes import free_port, run, run_merger, torchrun_cmd
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(fsdp_checkpoint):
    return fsdp_checkpoint("llama", world=2)


@pytest.fixture(scope="module")
def merged(checkpoint, tmp_path_factory):
    """A 2-rank merge with --verify into several files, with its summary."""
    actor, _ = checkpoint
    root = tmp_path_factory.mktemp("verified")
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", root / "out", "--verify",
                      "--max_shard_size", "20KB", "--summary-json", root / "summary.json", nproc=2)
    return root / "out", json.loads((root / "summary.json").read_text()), proc


def merger_test(capsys, *args) -> tuple[int, str]:
    """`merger test ARGS` in this process (one rank): its exit code and what it printed."""
    capsys.readouterr()
    code = cli.main(["test", *map(str, args)])
    return code, capsys.readouterr().out


def _flip_byte(folder: Path, tensor: str) -> None:
    """Flip one bit in the middle of `tensor`'s bytes in a finished output, found through the index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    path = folder / index["weight_map"][tensor]
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("atol,rtol", [(0.0, 0.0), (1e-3, 0.0), (0.0, 1e-2), (1e-4, 1e-3)])
def test_tolerance_rule_is_torch_isclose(atol, rtol):
    """Against torch.isclose(equal_nan=True); exact mode (both 0) compares bytes, so -0.0 differs from 0.0."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=gen)
    ours = ref + torch.randn(64, 32, generator=gen) * torch.rand(64, 32, generator=gen) * 1e-3
    ours[0, :4] = ref[0, :4]
    ref[1, 0], ours[1, 0] = float("nan"), float("nan")
    ref[2, 0], ours[2, 0] = 0.0, -0.0
    close = torch.isclose(ours.double(), ref.double(), atol=atol, rtol=rtol, equal_nan=True)
    if atol == rtol == 0:
        close[2, 0] = False  # the same value, other bytes
    found = _differences("w", ours, ref, atol, rtol)
    assert found is not None and found.bad == int((~close).sum()) and found.numel == ref.numel()
    assert found.max_abs_diff == (ours.double() - ref.double()).abs()[~close].max().item()
    assert _differences("w", ref.clone(), ref, atol, rtol) is None


def test_verify_passes_and_summary_describes_the_merge(merged, checkpoint):
    out, summary, proc = merged
    _, reference = checkpoint
    assert_same_weights(out, reference, torch.bfloat16)
    tensors = load_safetensors_folder(out)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert f"merger verify: {len(tensors)} tensors ({nbytes} bytes) compared, 0 differ" in proc.stdout
    assert "merger verify: PASSED" in proc.stdout

    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1
    assert summary["status"] == "ok" and summary["error"] is None
    assert summary["source_format"] == "fsdp"
    assert summary["checkpoint_world_size"] == 2 and summary["merge_world_size"] == 2
    assert summary["tensors"] == len(tensors) and summary["bytes"] == nbytes
    assert {f["name"]: f["bytes"] for f in summary["output_files"]} == {f.name: f.stat().st_size for f in files}
    assert len(summary["peak_rss_bytes_per_rank"]) == 2 and all(b > 0 for b in summary["peak_rss_bytes_per_rank"])
    assert summary["wall_time_s"] > 0
    assert summary["verify"]["ok"] and summary["verify"]["tensors"] == len(tensors)
    assert summary["verify"]["bytes"] == nbytes and summary["uploaded_to"] is None


def _stored_bytes(actor: Path) -> list[int]:
    """Tensor bytes in each verl rank file, as torch.load sees them."""
    from torch.distributed.tensor import DTensor

    sizes = []
    for path in sorted(actor.glob("model_world_size_*_rank_*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        local = [v.to_local() if isinstance(v, DTensor) else v for v in state.values()]
        sizes.append(sum(t.numel() * t.element_size() for t in local))
    return sizes


def test_fsdp_merge_moves_no_byte_between_ranks(merged, checkpoint, capsys):
    """verl FSDP slices are Shard(0): each rank casts what it read and writes it in place, so nothing is
    exchanged; each rank read its own rank file's tensors, and the writes add up to the output. `inspect
    --merge_ranks 2` says the same before any data moves."""
    out, summary, _ = merged
    actor, _ = checkpoint
    moved = summary["bytes_per_rank"]
    assert [m["sent_bytes"] for m in moved] == [m["received_bytes"] for m in moved] == [0, 0]
    assert [m["read_bytes"] for m in moved] == _stored_bytes(actor)
    written = load_safetensors_folder(out)
    assert sum(m["written_bytes"] for m in moved) == sum(t.numel() * t.element_size() for t in written.values())
    assert all(m["written_bytes"] > 0 for m in moved)

    capsys.readouterr()
    assert cli.main(["inspect", "--local_dir", str(actor), "--merge_ranks", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_rank"] == moved


def test_flipped_byte_is_caught_by_verify_and_test(merged, checkpoint, tmp_path):
    out, _, _ = merged
    actor, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    victim = "model.layers.1.mlp.up_proj.weight"
    _flip_byte(broken, victim)

    # merge --verify's own check, run on the damaged folder (the same function, given the merge's plan)
    options = MergeOptions(local_dir=actor, target_dir=broken, max_shard_size=20_000)
    with pytest.raises(MergerError, match="1 tensors differ"):
        verify_staged(broken, prepare(options, Group()), Group(), options)

    # `merger test` shares the comparison and prints the table of the worst mismatches, here on 2 ranks
    proc = run_merger("test", "--local_dir", actor, "--test_hf_dir", broken, nproc=2, check=False)
    assert proc.returncode == 1
    assert "1 differ" in proc.stdout and "merger test: FAILED" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith(victim))
    assert "1/" in row and "values differ" in row


def test_broken_index_is_reported(merged, checkpoint, tmp_path, capsys):
    out, _, _ = merged
    actor, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index["metadata"]["total_size"] += 2
    index_path.write_text(json.dumps(index))

    code, out = merger_test(capsys, "--local_dir", actor, "--test_hf_dir", broken)
    assert code == 1
    assert f"index puts {name} in {wrong}, which does not hold it" in out
    assert "index total_size is" in out and "merger test: FAILED" in out


def test_tolerances_pass_the_right_reference_and_fail_a_wrong_one(checkpoint, tmp_path, capsys):
    actor, reference = checkpoint
    assert merger_test(capsys, "--local_dir", actor, "--test_hf_dir", reference)[0] == 0

    # The q projections scaled by 1 + 1e-4 (near) or shifted by 0.1 (far), written by the safetensors library.
    weights = load_file(reference / "model.safetensors")
    near, far = tmp_path / "near", tmp_path / "far"
    for folder, change in ((near, lambda v: v * (1 + 1e-4)), (far, lambda v: v + 0.1)):
        folder.mkdir()
        shutil.copy(reference / "config.json", folder)
        changed = {k: change(v) if k.endswith("q_proj.weight") else v for k, v in weights.items()}
        save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})

    code, out = merger_test(capsys, "--local_dir", actor, "--test_hf_dir", near)
    assert code == 1 and "2 differ" in out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "max abs diff" in out
    assert merger_test(capsys, "--local_dir", actor, "--test_hf_dir", near, "--atol", "1e-3")[0] == 0
    assert merger_test(capsys, "--local_dir", actor, "--test_hf_dir", near, "--rtol", "1e-3")[0] == 0

    code, out = merger_test(capsys, "--local_dir", actor, "--test_hf_dir", far, "--atol", "1e-3")
    assert code == 1 and "merger test: FAILED" in out
    rows = [line for line in out.splitlines() if "values differ" in line]
    assert len(rows) == 2 and all("q_proj.weight" in r for r in rows)


HUB_RECORDER = HELPERS / "hub_recorder.py"  # as a script: merger's main() with the recorder


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """HfApi, as merger looks it up, replaced by the recorder; returns the log the calls go to."""
    log = tmp_path / "hub_calls.jsonl"
    monkeypatch.setattr(publish, "HfApi", lambda: RecordingHfApi(str(log)))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_sentinel_token")
    return log


@pytest.mark.parametrize("large", [False, True])
def test_upload_after_a_successful_merge(checkpoint, tmp_path, hub, monkeypatch, capsys, large):
    actor, reference = checkpoint
    if large:  # every folder counts as large: the resumable large-folder upload is used
        monkeypatch.setattr(publish, "LARGE_FOLDER_BYTES", 0)
    target = tmp_path / "out"
    code = cli.main(["merge", "--local_dir", str(actor), "--target_dir", str(target), "--verify",
                     "--hf_upload_path", "someone/tiny-merged", "--private", "--summary_json",
                     str(tmp_path / "s.json")])
    assert code == 0
    assert_same_weights(target, reference, torch.bfloat16)
    recorded = calls(hub)
    assert [c["method"] for c in recorded] == ["create_repo", "upload_large_folder" if large else "upload_folder"]
    assert recorded[0]["kwargs"] == {"repo_id": "someone/tiny-merged", "repo_type": "model", "private": True,
                                     "exist_ok": True}
    upload = recorded[1]["kwargs"]
    assert upload["repo_id"] == "someone/tiny-merged" and Path(upload["folder_path"]) == target
    assert "merge_manifest.json" in upload["ignore_patterns"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["uploaded_to"] == "https://huggingface.co/someone/tiny-merged" and summary["verify"]["ok"]
    captured = capsys.readouterr()
    assert "hf_secret_sentinel_token" not in captured.out + captured.err


def test_no_upload_when_the_merge_fails(checkpoint, tmp_path, hub, capsys):
    actor, _ = checkpoint
    target = tmp_path / "out"
    target.mkdir()
    (target / "precious.txt").write_text("not to be replaced")
    code = cli.main(["merge", "--local_dir", str(actor), "--target_dir", str(target),
                     "--hf_upload_path", "someone/tiny-merged", "--summary-json", str(tmp_path / "s.json")])
    assert code == os.EX_CANTCREAT and calls(hub) == []
    assert "target folder is not empty" in capsys.readouterr().err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "failed" and "not empty" in summary["error"] and summary["uploaded_to"] is None


def test_only_rank_zero_uploads(checkpoint, tmp_path):
    """Two ranks, each with the recorder in place of huggingface_hub.HfApi: one create, one upload, from rank 0."""
    actor, _ = checkpoint
    log = tmp_path / "hub_calls.jsonl"
    run(torchrun_cmd(2) + [str(HUB_RECORDER), "merge", "--local_dir", str(actor), "--target_dir",
                           str(tmp_path / "out"), "--hf_upload_path", "someone/m"],
        env={"MERGER_TEST_HUB_LOG": str(log)})
    recorded = calls(log)
    assert [(c["rank"], c["method"]) for c in recorded] == [(0, "create_repo"), (0, "upload_folder")]
    assert recorded[0]["kwargs"]["private"] is False


def test_a_failed_upload_is_retried_with_merger_upload(checkpoint, tmp_path, hub, capsys):
    """The real huggingface_hub, aimed at a closed port, fails the upload after a good merge. The model stays
    complete at the target, and the error line gives the command that uploads it without merging again: run
    (with the recorder as the Hub), it publishes that folder."""
    actor, reference = checkpoint
    target = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", target, "--hf_upload_path", "someone/m",
                      "--private", check=False,
                      env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_TOKEN": "hf_secret_sentinel_token"})
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "upload to the Hugging Face Hub repo someone/m failed" in errors[0]
    assert "hf_secret_sentinel_token" not in proc.stdout + proc.stderr
    assert_same_weights(target, reference, torch.bfloat16)

    retry = shlex.split(errors[0].split("retry the upload alone with: ", 1)[1])
    assert retry == ["merger", "upload", "--target_dir", str(target), "--hf_upload_path", "someone/m", "--private"]
    assert cli.main(retry[1:]) == 0
    recorded = calls(hub)
    assert [c["method"] for c in recorded] == ["create_repo", "upload_folder"]
    assert recorded[0]["kwargs"]["private"] is True and recorded[0]["kwargs"]["repo_id"] == "someone/m"
    assert Path(recorded[1]["kwargs"]["folder_path"]) == target
    assert capsys.readouterr().out.strip() == "https://huggingface.co/someone/m"


@pytest.mark.parametrize("case", ["missing", "not_merged", "unfinished", "truncated", "staging"])
def test_upload_refuses_anything_but_a_finished_merge(merged, checkpoint, tmp_path, hub, capsys, case):
    """`merger upload` publishes only what a merge finished, and says in one line why it will not."""
    out, _, _ = merged
    _, reference = checkpoint
    folder = {"missing": tmp_path / "nowhere", "not_merged": reference,  # save_pretrained's own folder
              "staging": tmp_path / ".out.merger-partial"}.get(case, tmp_path / "out")
    if case in ("unfinished", "truncated", "staging"):
        shutil.copytree(out, folder)
    if case == "unfinished":  # what the manifest of a merge still running or interrupted says
        manifest = json.loads((folder / "merge_manifest.json").read_text())
        (folder / "merge_manifest.json").write_text(json.dumps(dict(manifest, complete=False)))
    if case == "truncated":
        shard = sorted(folder.glob("*.safetensors"))[-1]
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1)
    capsys.readouterr()
    code = cli.main(["upload", "--target_dir", str(folder), "--hf_upload_path", "someone/m"])
    err = capsys.readouterr().err
    assert code == 1 and calls(hub) == []
    assert len(err.strip().splitlines()) == 1 and err.startswith("merger: error: "), err
    assert {"missing": "no such folder", "not_merged": "it has no merge_manifest.json",
            "unfinished": 'did not finish (merge_manifest.json lacks "complete": true)',
            "truncated": "the merged model is damaged", "staging": "the staging folder of a merge"}[case] in err
