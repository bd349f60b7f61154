"""The source is never written, one merge per target, and no output from bytes that changed under the merge.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint) copied into the test's folder.
The oracles are the model's own weights (save_pretrained), hashes of every source file before and after,
the processes' exit codes, and a second, real merge process run while the first holds the target.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import merger.output.local_target
from merger.engine.process_id import ProcessId
from merger.output.target_lock import STALE_AFTER_S
from tests.helpers.files import snapshot, tmpfs
from tests.helpers.hub_cache import cache_model
from tests.helpers.in_process import merge_here
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

WORLD = 2
RANK1 = f"model_world_size_{WORLD}_rank_1.pt"


@pytest.fixture(scope="module")
def pristine(fsdp_checkpoint):
    return fsdp_checkpoint("llama", WORLD)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private copy of the real checkpoint at tmp/src/global_step_1/actor."""
    return Path(shutil.copytree(pristine[0], tmp_path / "src" / "global_step_1" / "actor"))


@pytest.fixture
def reference(pristine) -> Path:
    return pristine[1]


# --- the source is never written, moved or deleted ------------------------------------------------------------

@pytest.mark.parametrize("where", ["the checkpoint", "its parent", "its grandparent", "inside it"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_target_that_is_holds_or_lies_in_the_source_is_refused(where, overwrite, ckpt, capsys):
    target = {"the checkpoint": ckpt, "its parent": ckpt.parent, "its grandparent": ckpt.parent.parent,
              "inside it": ckpt / "merged"}[where]
    before = snapshot(ckpt.parent.parent)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", target,
                              *(["--overwrite"] if overwrite else []))
    assert code == os.EX_CANTCREAT and len(errors) == 1, errors
    assert "merger never writes into its source" in errors[0] and errors[0].endswith(str(target))
    assert snapshot(ckpt.parent.parent) == before
    assert not list(ckpt.parent.parent.rglob(".*merger*"))  # no staging folder, no lock


def test_merging_into_the_checkpoints_config_folder_adds_the_weights_beside_it(ckpt, reference, capsys):
    """verl's own CI flow: `--target_dir actor/huggingface`. Weights, index and manifest are added; the tokenizer
    and rank files stay byte for byte, config.json but for its dtype (verl's says float32, the weights are bf16)."""
    hf = ckpt / "huggingface"
    config = json.loads((hf / "config.json").read_text())
    before_hf, before_ranks = snapshot(hf), {k: v for k, v in snapshot(ckpt).items() if "/" not in k}
    del before_hf["config.json"]
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", hf, "--max_shard_size", "20KB")
    assert code == 0, errors
    assert {k: v for k, v in snapshot(ckpt).items() if "/" not in k} == before_ranks
    after = snapshot(hf)
    assert {k: after[k] for k in before_hf} == before_hf  # nothing else replaced
    assert json.loads((hf / "config.json").read_text()) == {**config, "dtype": "bfloat16"}
    added = set(after) - set(before_hf) - {"config.json"}
    assert "model.safetensors.index.json" in added and "merge_manifest.json" in added
    assert added == {"model.safetensors.index.json", "merge_manifest.json",
                     *json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"].values()}
    assert_same_weights(hf, reference, torch.bfloat16)
    assert not [p for p in hf.iterdir() if p.name.startswith(".")]  # no staging folder, no lock left

    # transformers loads the folder as a model, in the weights' dtype that its config now states.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    ref = load_file(reference / "model.safetensors")
    assert torch.equal(model.state_dict()["model.norm.weight"], ref["model.norm.weight"].to(torch.bfloat16))

    # Again: the earlier merge's files are replaced only with --overwrite, one shard layout by another.
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", hf)
    assert code == os.EX_CANTCREAT and "earlier merge: pass --overwrite" in errors[0], errors
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", hf, "--overwrite")
    assert code == 0, errors
    final = snapshot(hf)
    assert {k: final[k] for k in before_hf} == before_hf
    assert set(final) - set(before_hf) == {"config.json", "model.safetensors", "merge_manifest.json"}  # old shards gone
    assert_same_weights(hf, reference, torch.bfloat16)


def test_weights_in_the_config_folder_that_no_merge_wrote_are_never_replaced(ckpt, capsys):
    hf = ckpt / "huggingface"
    (hf / "model.safetensors").write_bytes(b"the user's own weights")
    before = snapshot(ckpt)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", hf, "--overwrite")
    assert code == os.EX_CANTCREAT and len(errors) == 1 and "which no merger run wrote" in errors[0], errors
    assert errors[0].endswith(str(hf / "model.safetensors"))
    assert snapshot(ckpt) == before


def test_overwrite_replaces_only_an_earlier_merge(ckpt, reference, tmp_path, capsys):
    user = tmp_path / "user_folder"
    user.mkdir()
    (user / "notes.txt").write_text("user data")
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", user, "--overwrite")
    assert code == os.EX_CANTCREAT and "holds no merger output" in errors[0] and "--overwrite" not in errors[0], errors
    assert (user / "notes.txt").read_text() == "user data"

    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)[0] == 0
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == os.EX_CANTCREAT and "pass --overwrite to replace it" in errors[0], errors
    (out / "stale.txt").write_text("from the earlier merge's folder")
    assert merge_here(capsys, "--local_dir", ckpt, "--target_dir", out, "--overwrite")[0] == 0
    assert not (out / "stale.txt").exists()
    assert_same_weights(out, reference, torch.bfloat16)


def test_a_target_that_cannot_be_renamed_into_place_is_refused_before_streaming(ckpt, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", link)
    assert code == os.EX_CANTCREAT and "symbolic link" in errors[0] and errors[0].endswith(str(link)), errors
    assert link.is_symlink() and list(real.iterdir()) == []

    with tmpfs(tmp_path / "mnt", "size=1m") as mnt:
        code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", mnt)
        assert code == os.EX_CANTCREAT and "mount point" in errors[0] and errors[0].endswith(str(mnt)), errors
        assert list(mnt.iterdir()) == [] and not list(tmp_path.glob(".mnt.merger*"))


# --- one merge per target -------------------------------------------------------------------------------------

def test_a_second_merge_into_the_same_target_fails_at_once_naming_the_first(ckpt, reference, tmp_path, capsys,
                                                                              monkeypatch):
    out = tmp_path / "out"
    seen = {}
    real_finish = merger.output.local_target.finish

    def finish_after_a_rival(*args, **kwargs):
        # The first merge has streamed every byte into its staging folder; a second one starts now.
        started = time.monotonic()
        seen["rival"] = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, "--overwrite", check=False)
        seen["seconds"] = time.monotonic() - started
        with pytest.raises(merger.TargetBusyError) as busy:  # the API's rival: the same lock, the same line
            merger.merge(local_dir=ckpt, target_dir=out, overwrite=True)
        seen["api"] = busy.value
        seen["stage"] = sorted(p.name for p in (tmp_path / ".out.merger-partial").iterdir())
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(merger.output.local_target, "finish", finish_after_a_rival)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 0, errors
    rival = seen["rival"]
    assert rival.returncode == os.EX_TEMPFAIL and "another merge is writing this target" in rival.stderr, rival.stderr
    assert f"pid {os.getpid()} on {socket.gethostname()}" in rival.stderr
    assert seen["api"].kind == "target_busy" and f"pid {os.getpid()} on {socket.gethostname()}" in str(seen["api"])
    assert seen["stage"] and seen["seconds"] < 30  # it left the live staging folder alone, and did not wait
    assert_same_weights(out, reference, torch.bfloat16)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["complete"] is True
    assert not list(tmp_path.glob(".out.merger*"))  # the lock is gone with the merge


def _lock_of(target: Path) -> Path:
    return target.parent / f".{target.name}.merger-lock"


def test_a_stale_lock_is_broken_and_a_live_one_from_another_host_is_not(ckpt, reference, tmp_path, capsys):
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: its merge was killed
    here = ProcessId.of_this_process()
    _lock_of(out).write_text(json.dumps({**asdict(dataclasses.replace(here, pid=dead.pid, start="1")),
                                         "started": "earlier", "command": "merger merge", "token": "x"}))
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 0, errors
    assert_same_weights(out, reference, torch.bfloat16)
    assert not _lock_of(out).exists()

    other = tmp_path / "other"
    record = {"host": "another-node", "pid": 1, "started": "now", "command": "merger merge", "token": "y"}
    _lock_of(other).write_text(json.dumps(record))
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", other)
    assert code == os.EX_TEMPFAIL and "pid 1 on another-node" in errors[0], errors
    assert not other.exists()
    old = time.time() - STALE_AFTER_S - 60  # its holder stopped refreshing it long ago
    os.utime(_lock_of(other), (old, old))
    assert merge_here(capsys, "--local_dir", ckpt, "--target_dir", other)[0] == 0


# --- no output from bytes that changed under the merge -------------------------------------------------------

def _rewrite_same_size(path: Path) -> None:
    """What a trainer overwriting its checkpoint does to a file: new values, the same size (mtime set back)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-200:-100] = bytes(b ^ 0xFF for b in data[-200:-100])  # inside the last storage record or the zip tail
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_source_rewritten_during_the_merge_is_an_error_and_nothing_is_moved(ckpt, tmp_path, capsys,
                                                                                monkeypatch):
    out = tmp_path / "out"
    real_finish = merger.output.local_target.finish

    def finish_after_a_rewrite(*args, **kwargs):
        _rewrite_same_size(ckpt / RANK1)
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(merger.output.local_target, "finish", finish_after_a_rewrite)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 1 and len(errors) == 1, errors
    assert "source file changed while it was being merged" in errors[0] and "ctime_ns" in errors[0], errors
    assert errors[0].endswith(str(ckpt / RANK1))
    assert not out.exists() and not list(tmp_path.glob(".out.merger*"))


def test_a_source_deleted_during_the_merge_is_one_line_and_nothing_is_moved(ckpt, tmp_path, capsys, monkeypatch):
    """A trainer that keeps its last K checkpoints deletes the oldest while a merge reads it (#52 item 2)."""
    out = tmp_path / "out"
    real_finish = merger.output.local_target.finish

    def finish_after_a_rotation(*args, **kwargs):
        shutil.rmtree(ckpt)
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(merger.output.local_target, "finish", finish_after_a_rotation)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 1 and len(errors) == 1, errors
    assert str(ckpt) in errors[0], errors
    assert not out.exists() and not list(tmp_path.glob(".out.merger*"))


# --- casts that lose values -------------------------------------------------------------------------------------

@pytest.fixture
def huge_values(reference, tmp_path) -> Path:
    """A HF folder (save_pretrained's output) with values beyond float16's range in one tensor."""
    folder = Path(shutil.copytree(reference, tmp_path / "huge"))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][:3] = torch.tensor([1e6, -7e4, float("inf")])  # the inf is the source's own
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_float16_overflow_is_an_error_naming_the_tensor(huge_values, tmp_path, capsys):
    out = tmp_path / "out"
    code, errors = merge_here(capsys, "--local_dir", huge_values, "--target_dir", out, "--dtype", "float16")
    assert code == 1 and len(errors) == 1, errors
    assert "float16 cannot hold" in errors[0] and "model.norm.weight" in errors[0] and "1 tensors" in errors[0]
    assert not out.exists() and not list(tmp_path.glob(".out.merger*"))

    # Accepted on request: the output then holds inf where the source had values beyond the range.
    code, errors = merge_here(capsys, "--local_dir", huge_values, "--target_dir", out, "--dtype", "float16",
                              "--allow_overflow", "--verify")
    assert code == 0, errors
    norm = load_safetensors_folder(out)["model.norm.weight"]
    assert norm[:3].tolist() == [float("inf"), float("-inf"), float("inf")]


def test_bad_sizes_are_one_line_naming_the_flag(ckpt, tmp_path):
    for flag, value in (("--max_shard_size", "5G"), ("--max_inflight", "abc")):
        proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", flag, value, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"argument {flag}" in proc.stderr and f"cannot read size '{value}'" in proc.stderr
        assert not (tmp_path / "out").exists()


def test_resume_after_a_merge_that_finished_has_nothing_to_do(ckpt, reference, tmp_path, capsys):
    """docs/reliability.md's `--keep-partial`, then `--resume`, when the first run was not interrupted after all."""
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", ckpt, "--target_dir", out, "--keep-partial")[0] == 0
    before = snapshot(out)
    resumed = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, "--resume", nproc=2)
    assert "already holds this merge, complete and intact: nothing to do" in resumed.stderr
    assert snapshot(out) == before

    other = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, "--resume", "--dtype", "float32",
                       check=False)
    assert other.returncode == os.EX_CANTCREAT and "options that shape the output changed" in other.stderr
    assert "pass --overwrite to replace it" in other.stderr and snapshot(out) == before
    assert_same_weights(out, reference, torch.bfloat16)


# --- the files a checkpoint names lie inside it ------------------------------------------------------------------

@pytest.fixture
def sharded(reference, tmp_path) -> Path:
    """The model's weights as transformers saves a large model: several files and model.safetensors.index.json."""
    import transformers

    folder = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(reference).save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _moved_out(folder: Path) -> tuple[Path, Path]:
    """The folder's last weight file moved beside the folder: (where it was, where it is now)."""
    inside = sorted(folder.glob("model-*.safetensors"))[-1]
    outside = folder.parent / "outside.safetensors"
    inside.rename(outside)
    return inside, outside


def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path, capsys):
    inside, outside = _moved_out(sharded)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: "../outside.safetensors" if v == inside.name else v
                           for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    code, errors = merge_here(capsys, "--local_dir", sharded, "--target_dir", tmp_path / "out")
    assert code == 1 and len(errors) == 1, errors
    assert "'../outside.safetensors', which lies outside the checkpoint folder" in errors[0], errors
    assert errors[0].endswith(str(index_path)) and not (tmp_path / "out").exists()


def test_a_weight_file_linked_out_of_the_folder_is_refused(sharded, tmp_path, capsys):
    inside, outside = _moved_out(sharded)
    inside.symlink_to(outside)  # the index is as saved; the file it names is a link out of the folder
    code, errors = merge_here(capsys, "--local_dir", sharded, "--target_dir", tmp_path / "out")
    assert code == 1 and len(errors) == 1, errors
    assert f"'{inside.name}', which lies outside the checkpoint folder" in errors[0], errors
    assert errors[0].endswith(str(sharded / "model.safetensors.index.json"))


def test_a_weight_file_linked_within_the_folder_merges(sharded, reference, tmp_path, capsys):
    inside = sorted(sharded.glob("model-*.safetensors"))[-1]
    (sharded / "stored").mkdir()
    inside.rename(sharded / "stored" / inside.name)
    inside.symlink_to(Path("stored") / inside.name)
    code, errors = merge_here(capsys, "--local_dir", sharded, "--target_dir", tmp_path / "out", "--dtype", "keep")
    assert code == 0, errors
    assert_same_weights(tmp_path / "out", reference, None)


def test_a_hub_cache_snapshot_with_an_index_merges(sharded, reference, tmp_path, capsys):
    """A snapshot's files are links into its repo's blobs/, outside the snapshot folder: allowed there alone."""
    snapshot = cache_model(tmp_path / "hub", "merger-test/sharded", sharded)
    code, errors = merge_here(capsys, "--local_dir", snapshot, "--target_dir", tmp_path / "out", "--dtype", "keep")
    assert code == 0, errors
    assert_same_weights(tmp_path / "out", reference, None)
