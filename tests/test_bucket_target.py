"""Merged models written straight into a bucket (`--target_dir s3://...`), against moto's S3 server on the loopback.

Oracle: the same merge into a local folder, whose own tests check it against the training library; the objects
in the bucket must hold the same bytes. The weights of a HF folder merged as float32 are also compared with the
folder transformers' save_pretrained wrote. The server speaks the S3 protocol over HTTP (multipart uploads,
conditional puts, listings), so merger's client calls run as they would against AWS.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from merger.output.bucket_target import MAX_PARTS, PART, parts_of, shares
from tests.helpers.files import allocated, assert_same_files, peak_allocated, removed_after, tmpfs
from tests.helpers.in_process import run_in_process, single_error_line
from tests.helpers.object_store import KEY_ID, SECRET, STREAMED, download, open_uploads, paused_merge
from tests.helpers.processes import run_merger
from tests.helpers.reliability import kill_rank_mid_merge, lost_line
from tests.helpers.weights import assert_same_weights

pytestmark = [pytest.mark.infra, pytest.mark.slow]

MIB = 1 << 20


@pytest.fixture(scope="module")
def store(s3_server):
    s3_server.client().create_bucket(Bucket="models")
    return s3_server


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory) -> Iterator[Path]:
    """A save_pretrained Llama of ~580 MB in float32, in tensors of 4 MiB at most: merged with STREAMED's flags it
    is 29 files of 20 MB (two parts each) written in about 110 batches."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=2048, num_hidden_layers=36,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with removed_after(tmp_path_factory.mktemp("bucket_stream")) as folder:
        transformers.LlamaForCausalLM(config).save_pretrained(folder / "hf", max_shard_size="1GB")
        yield folder / "hf"


@pytest.fixture(scope="module")
def layered_local(layered_model, tmp_path_factory) -> Iterator[Path]:
    """The oracle: layered_model merged with STREAMED's flags into a local folder."""
    with removed_after(tmp_path_factory.mktemp("bucket_stream")) as folder:
        run_in_process("merge", "--local_dir", layered_model, "--target_dir", folder / "local", *STREAMED)
        yield folder / "local"


def no_secret(proc: subprocess.CompletedProcess, folder: Path) -> None:
    said = proc.stdout + proc.stderr
    assert SECRET not in said and KEY_ID not in said
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and KEY_ID.encode() not in data, path


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_merge_into_a_bucket_writes_what_a_local_merge_writes(store, llama34, llama34_local, nproc, tmp_path):
    remote = tmp_path / "remote"
    url = f"s3://models/llama-x{nproc}"
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, "--dtype", "float32",
                      "--summary_json", tmp_path / "summary.json", nproc=nproc, env=store.env)
    names = download(store, f"llama-x{nproc}", remote)
    assert ".merger-lock" not in names and open_uploads(store) == []
    assert_same_files(llama34_local, remote)
    assert_same_weights(remote, llama34, None)  # float32 as save_pretrained wrote them
    assert json.loads((tmp_path / "summary.json").read_text())["target_dir"] == url
    assert f"to {url}" in proc.stderr and "uploaded 4 files" in proc.stderr, proc.stderr
    no_secret(proc, remote)


def test_a_dcp_checkpoint_from_one_bucket_into_another_on_two_ranks(store, dcp_root, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    source = store.upload(dcp_root, "ckpt", "runs/dcp")
    run_in_process("merge", "--local_dir", dcp_root / "plain", "--target_dir", local)
    run_merger("merge", "--local_dir", f"{source}/plain", "--target_dir", "s3://models/dcp", nproc=2,
               env=store.env)
    download(store, "dcp", remote)
    assert_same_files(local, remote)
    assert_same_weights(remote, dcp_root / "reference", torch.bfloat16)


def test_peft_adapters_folded_into_a_base_model_in_a_bucket(store, adapter_cases, tmp_path):
    """`merger lora` into a bucket: the same bytes as into a folder (whose tests check PEFT's merge_and_unload)."""
    root = adapter_cases / "llama"
    run_in_process("lora", "--base", root / "base", "--adapter", root / "patterns", "--target_dir", tmp_path / "local")
    run_in_process("lora", "--base", root / "base", "--adapter", root / "patterns", "--target_dir",
                   "s3://models/lora", env=store.env)
    download(store, "lora", tmp_path / "remote")
    assert_same_files(tmp_path / "local", tmp_path / "remote")


def test_an_earlier_merge_is_replaced_only_with_overwrite(store, llama34, tmp_path):
    url = "s3://models/again"
    run_in_process("merge", "--local_dir", llama34, "--target_dir", url, "--max_shard_size", "20MB", env=store.env)
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, env=store.env, check=False)
    assert proc.returncode == os.EX_CANTCREAT
    assert single_error_line(proc.stderr) == f"merger: error: target holds an earlier merge: pass --overwrite to " \
                                              f"replace it, {url}"
    run_in_process("merge", "--local_dir", llama34, "--target_dir", url, "--overwrite", env=store.env)
    run_in_process("merge", "--local_dir", llama34, "--target_dir", tmp_path / "local")
    remote = tmp_path / "remote"
    download(store, "again", remote)  # the earlier merge's two shards and index are gone: one file now
    assert_same_files(tmp_path / "local", remote)


def test_a_prefix_holding_other_objects_is_left_alone(store, llama34):
    store.client().put_object(Bucket="models", Key="notes/readme.txt", Body=b"not a model")
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://models/notes", "--overwrite",
                      env=store.env, check=False)
    assert proc.returncode == os.EX_CANTCREAT
    assert single_error_line(proc.stderr) == (
        "merger: error: target holds objects and no merger output (no merge_manifest.json): merger replaces only "
        "an empty prefix or an earlier merge; choose another --target_dir, s3://models/notes")
    keys = [o["Key"] for o in store.client().list_objects_v2(Bucket="models", Prefix="notes/")["Contents"]]
    assert keys == ["notes/readme.txt"]


def test_a_merge_running_elsewhere_holds_the_target(store, llama34):
    """The lock object of a merge on another host: a second merge stops before writing, naming the holder."""
    holder = {"host": "node-7", "pid": 4242, "kernel": "elsewhere", "start": "1", "started": "earlier",
              "command": "merger merge ...", "token": "theirs"}
    store.client().put_object(Bucket="models", Key="busy/.merger-lock", Body=json.dumps(holder).encode())
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://models/busy", env=store.env,
                      check=False)
    assert proc.returncode == os.EX_TEMPFAIL
    line = single_error_line(proc.stderr)
    assert line.startswith("merger: error: another merge is writing this target (pid 4242 on node-7"), line
    assert line.endswith("remove s3://models/busy/.merger-lock, s3://models/busy"), line
    keys = [o["Key"] for o in store.client().list_objects_v2(Bucket="models", Prefix="busy/")["Contents"]]
    assert keys == ["busy/.merger-lock"]


def test_a_killed_merge_leaves_no_model_and_the_next_one_cleans_up(store, llama34, llama34_local, tmp_path):
    """kill -9 during the upload: the parts sent are invisible, nothing reads as a model; the next merge finds the
    lock stale (its process is gone), aborts the unfinished upload and writes the model."""
    url, stage = "s3://models/killed", tmp_path / "stage"
    proc = subprocess.Popen([sys.executable, "-m", "merger", "merge", "--local_dir", str(llama34), "--target_dir",
                             url, "--stage_dir", str(stage), "--dtype", "float32"],
                            env={**os.environ, **store.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    client = store.client()
    while proc.poll() is None and not client.list_multipart_uploads(Bucket="models").get("Uploads"):
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    if proc.returncode == 0:
        pytest.fail("the merge finished before an upload was seen: make the model larger")
    left = [o["Key"] for o in client.list_objects_v2(Bucket="models", Prefix="killed/").get("Contents", [])]
    assert set(left) <= {"killed/.merger-lock"}, left  # no weights, config, index or manifest
    assert open_uploads(store) == ["killed/model.safetensors"]
    run_in_process("merge", "--local_dir", llama34, "--target_dir", url, "--stage_dir", stage, "--dtype", "float32",
                   "--resume", env=store.env)
    assert open_uploads(store) == []
    download(store, "killed", tmp_path / "remote")
    assert_same_files(llama34_local, tmp_path / "remote")


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_upload_streams_and_the_stage_never_holds_the_model(store, layered_model, layered_local, nproc,
                                                                 tmp_path):
    """Each file's parts are sent as soon as its blocks are written and their disk space given back: the staging
    folder's allocated blocks, sampled through the merge, stay far below the model's size; the objects hold what a
    local merge writes."""
    local, work = layered_local, tmp_path / "work"
    weights = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    assert len(list(local.glob("*.safetensors"))) >= 25 and weights > 500 * MIB
    url = f"s3://models/streamed-x{nproc}"
    with peak_allocated(work) as peak:
        run_merger("merge", "--local_dir", layered_model, "--target_dir", url, "--stage_dir", work / "stage",
                   *STREAMED, nproc=nproc, env=store.env)
    download(store, f"streamed-x{nproc}", tmp_path / "remote")
    assert_same_files(local, tmp_path / "remote")
    assert open_uploads(store) == []
    # Per rank: the parts being written and four in flight (docs/object_storage.md), 80-150 MiB here; a merge
    # that uploads after it holds the whole model.
    assert 0 < peak[0] < weights / 2, (peak[0], weights)
    assert allocated(work) < MIB  # what stays in --stage_dir: the small files, the weight files hollow


def test_verify_keeps_the_staged_files_whole_for_its_check(store, llama34, llama34_local, tmp_path):
    """--verify re-reads the staged model after the merge: its parts are sent during the merge but not released."""
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://models/verified", "--dtype", "float32",
                      "--verify", env=store.env)
    assert "comparing 100%" in proc.stderr, proc.stderr  # the check ran, and passed on the staged bytes
    download(store, "verified", tmp_path / "remote")
    assert_same_files(llama34_local, tmp_path / "remote")


def _sent_parts(store, prefix: str) -> int:
    """The parts of the uploads under `prefix` the store holds, once it holds some (0 after a minute): a paused
    merge's upload threads go on sending the parts queued before the pause, which may still be on their way."""
    client = store.client()
    deadline = time.monotonic() + 60
    while True:
        sent = sum(len(client.list_parts(Bucket="models", Key=u["Key"], UploadId=u["UploadId"]).get("Parts", []))
                   for u in client.list_multipart_uploads(Bucket="models", Prefix=f"{prefix}/").get("Uploads", []))
        if sent or time.monotonic() > deadline:
            return sent
        time.sleep(0.1)


def _resumed_as_local(store, model: Path, local: Path, url: str, stage: Path, tmp_path: Path) -> None:
    """--resume writes again what was sent and released (its blocks fail their checksums), and the objects end
    as a local merge's; the files it reused are released once sent, so the stage ends hollow as after any merge."""
    proc = run_merger("merge", "--local_dir", model, "--target_dir", url, "--stage_dir", stage, *STREAMED,
                      "--resume", env=store.env)
    reused = re.search(r"--resume: reusing (\d+) of (\d+) output files", proc.stderr)
    assert reused and int(reused[1]) < int(reused[2]), proc.stderr  # the files sent (and released) are written again
    prefix = url.removeprefix("s3://models/")
    download(store, prefix, tmp_path / "remote")
    assert_same_files(local, tmp_path / "remote")
    assert open_uploads(store) == []
    held = {p.name: p.stat().st_blocks * 512 for p in stage.glob("*.safetensors") if p.stat().st_blocks}
    assert allocated(stage) < MIB, held  # the small files, the weight files hollow (docs/object_storage.md)


def test_ctrl_c_mid_stream_aborts_the_uploads_and_resume_finishes(store, layered_model, layered_local, tmp_path):
    url, stage = "s3://models/interrupted", tmp_path / "stage"
    with paused_merge(store.env, layered_model, url, stage, tmp_path / "paused") as proc:
        assert _sent_parts(store, "interrupted") > 0  # mid-upload: parts sent, no upload complete
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "merger: error: interrupted by SIGINT" in err, err
    assert open_uploads(store) == []  # every upload begun, aborted
    client = store.client()
    left = [o["Key"] for o in client.list_objects_v2(Bucket="models", Prefix="interrupted/").get("Contents", [])]
    assert not [k for k in left if not k.endswith(".safetensors")], left  # no lock, config, index or manifest
    _resumed_as_local(store, layered_model, layered_local, url, stage, tmp_path)


def test_files_a_resume_reuses_are_released_once_sent(store, layered_model, layered_local, tmp_path):
    """Files written and not yet sent when a merge stops pass their checksums: --resume reuses them and sends them
    after the merge, giving back their space as it goes, so the stage ends hollow as after any merge. Here an
    interrupted --verify merge, which sends its parts but keeps the staged files whole, leaves such files."""
    url, stage = "s3://models/reused", tmp_path / "stage"
    with paused_merge(store.env, layered_model, url, stage, tmp_path / "paused", flags=("--verify",)) as proc:
        assert _sent_parts(store, "reused") > 0
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert allocated(tmp_path) > PART  # the partial merge beside --stage_dir holds files kept whole
    _resumed_as_local(store, layered_model, layered_local, url, stage, tmp_path)


def test_ctrl_c_without_a_stage_dir_names_no_folder_it_removed(store, layered_model, tmp_path):
    """Without --stage_dir the merge is staged in a temporary folder, removed on the way out: the interrupted run
    must not point at a partial merge there for --resume. Every path its lines name exists afterwards."""
    url, temp = "s3://models/interrupted-unstaged", tmp_path / "tmp"
    temp.mkdir()
    with paused_merge(store.env, layered_model, url, None, tmp_path / "paused", env={"TMPDIR": str(temp)}) as proc:
        assert _sent_parts(store, "interrupted-unstaged") > 0
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert single_error_line(err).startswith(f"merger: error: interrupted by SIGINT; nothing was written to {url}")
    named = [Path(p.rstrip(".,;:)")) for line in err.splitlines() if line.startswith("merger")
             for p in re.findall(r"(?<![:/\w])/\S+", line)]  # local paths, not the s3:// URL
    assert [p for p in named if not p.exists()] == [], err
    assert list(temp.iterdir()) == []  # the temporary folder removed: nothing kept
    assert open_uploads(store) == []


@pytest.mark.parametrize("launch", ["torchrun", "env"])
def test_a_lost_rank_leaves_nothing_of_the_merge_in_the_bucket(launch, store, layered_model, tmp_path):
    """Rank 1 of 2 killed mid-stream, rank 0 in a collective: one line names the lost rank, and before its process
    ends rank 0 aborts the uploads begun and releases the bucket's lock, and its temporary folder goes: nothing of
    the merge is left, and the next merge needs no stale lock to be found first."""
    prefix, temp = f"lost-{launch}", tmp_path / "tmp"
    temp.mkdir()

    def parts_sent() -> None:
        assert _sent_parts(store, prefix) > 0

    proc, took, killed = kill_rank_mid_merge(layered_model, f"s3://models/{prefix}", tmp_path, *STREAMED,
                                             after_batch=5, pause_all=False, launch=launch,
                                             env={**store.env, "TMPDIR": str(temp)}, before_kill=parts_sent)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert errors == [lost_line(1, killed)], proc.stderr
    left = store.client().list_objects_v2(Bucket="models", Prefix=f"{prefix}/").get("Contents", [])
    assert [o["Key"] for o in left] == [], proc.stderr  # not even the lock
    assert [k for k in open_uploads(store) if k.startswith(f"{prefix}/")] == []
    assert [p.name for p in temp.iterdir() if p.name.startswith("merger-")] == []  # (torchrun leaves its own)


def test_kill_9_mid_stream_then_resume(store, layered_model, layered_local, tmp_path):
    url, stage = "s3://models/killed-streaming", tmp_path / "stage"
    with paused_merge(store.env, layered_model, url, stage, tmp_path / "paused") as proc:
        assert _sent_parts(store, "killed-streaming") > 0
        proc.kill()
        proc.wait()
    client = store.client()
    left = [o["Key"] for o in client.list_objects_v2(Bucket="models", Prefix="killed-streaming/").get("Contents", [])]
    assert not [k for k in left if not k.endswith((".safetensors", ".merger-lock"))], left
    _resumed_as_local(store, layered_model, layered_local, url, stage, tmp_path)


def test_a_missing_bucket_is_one_line(store, llama34, tmp_path):
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://no-such-bucket/model", env=store.env,
                      check=False)
    assert proc.returncode == os.EX_CANTCREAT
    assert single_error_line(proc.stderr) == "merger: error: no such bucket, s3://no-such-bucket"


def test_targets_other_than_a_folder_or_a_bucket_are_refused_at_the_flag(llama34):
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "ftp://models/x", check=False)
    assert proc.returncode == 2
    assert "merged models are written to a local folder or a bucket (s3://, gs://, az://), not to ftp://" in \
        proc.stderr


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 5, 10 * MAX_PARTS * PART + 7])
def test_parts_cover_each_file_once_within_s3s_limits(size):
    """S3's rules for a multipart upload: parts of 5 MiB to 5 GiB but the last, at most 10,000 of them."""
    parts = parts_of({"a": size})
    assert [p.number for p in parts] == list(range(1, len(parts) + 1)) and len(parts) <= MAX_PARTS
    assert all(p.parts == len(parts) for p in parts)
    assert sum(p.size for p in parts) == size and [p.start for p in parts] == [sum(q.size for q in parts[:i])
                                                                            for i in range(len(parts))]
    assert all(5 * MIB <= p.size <= 5 << 30 for p in parts[:-1])


def test_shares_give_every_part_to_one_rank_and_balance_bytes():
    parts = parts_of({"a": 7 * PART + 3, "b": PART // 2, "c": 2 * PART})
    for world in (1, 2, 3, 8):
        given = shares(parts, world)
        assert sorted((p.name, p.number) for share in given for p in share) == sorted((p.name, p.number)
                                                                                      for p in parts)
        loads = [sum(p.size for p in share) for share in given]
        assert max(loads) - min(loads) <= PART



def test_the_temp_folder_needs_room_for_the_parts_in_flight_not_the_model(store, layered_model, layered_local, tmp_path):
    """Without --stage_dir the parts are staged in $TMPDIR: a folder with room for a batch and the parts in flight
    (80 MiB with STREAMED's 16 MB batches), not for the model (580 MB), takes the merge. The free-space check asked for
    the whole model and refused it, against what docs/object_storage.md promises a 1 TB model."""
    url = "s3://models/small-temp"
    weights = sum(p.stat().st_size for p in layered_local.glob("*.safetensors"))
    with tmpfs(tmp_path / "tmp", "size=200m") as temp:
        assert weights > 2 * shutil.disk_usage(temp).free
        run_merger("merge", "--local_dir", layered_model, "--target_dir", url, *STREAMED,
                   env={**store.env, "TMPDIR": str(temp)})
        assert list(temp.iterdir()) == []
    download(store, "small-temp", tmp_path / "remote")
    assert_same_files(layered_local, tmp_path / "remote")
    assert open_uploads(store) == []


def test_a_temp_folder_without_room_for_the_parts_in_flight_is_one_line(store, llama34, tmp_path):
    """A $TMPDIR without room even for the parts in flight (64 KiB): refused before anything is written, one line
    naming the folder and the room it needs, the target's exit code; nothing in the bucket or left in $TMPDIR."""
    url = "s3://models/no-room"
    with tmpfs(tmp_path / "tmp", "size=64k") as temp:
        proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, check=False,
                          env={**store.env, "TMPDIR": str(temp)})
        left = list(temp.iterdir())
    line = single_error_line(proc.stderr)
    assert proc.returncode == 73 and "Traceback" not in proc.stderr, proc.stderr
    assert line.startswith("merger: error: not enough free space for the merged model: it needs "), line
    assert f", {temp}/merger-upload-" in line, line
    assert not left, left
    assert download(store, "no-room", tmp_path / "remote") == [] and open_uploads(store) == []
