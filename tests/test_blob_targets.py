"""Merged models written straight into Google Cloud Storage and Azure Blob Storage (`--target_dir gs://...`,
`az://...`), against gcp-storage-emulator and Azurite on the loopback.

Oracle: the same merge into a local folder, whose own tests check it against the training library; the objects in
the bucket must hold the same bytes. The emulators speak each store's protocol over HTTP (GCS's uploads, compose and
conditional creates; Azure's block blobs staged block by block and committed by a block list, conditional puts,
account keys it checks), so merger's client calls run as they would against the clouds. What the s3:// target
promises (tests/test_bucket_target.py) holds here: the same bytes from 1 and 2 ranks, one merge per prefix, nothing
that reads as a model until it is one, --resume after kill -9, one line for a wrong key.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.helpers.emulators import SERVERS
from tests.helpers.files import assert_same_files
from tests.helpers.in_process import run_in_process, single_error_line
from tests.helpers.object_store import STREAMED, paused_merge
from tests.helpers.processes import run_merger

pytestmark = [pytest.mark.infra, pytest.mark.slow]

PARTS = ".merger-parts/"  # where merger's GCS writer keeps the parts of the uploads it has not composed yet


@pytest.fixture(scope="module", params=["gs", "az"])
def store(request):
    server = request.getfixturevalue(SERVERS[request.param])
    server.bucket("models")
    return server


def visible(store, prefix: str) -> list[str]:
    """What a reader of the prefix takes for the model's files: every object but GCS's parts."""
    return [n for n in store.names("models", prefix) if not n.startswith(PARTS)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_merge_into_a_bucket_writes_what_a_local_merge_writes(store, llama34, llama34_local, nproc, tmp_path):
    """llama34's one weight file is three parts of PART bytes, sent by whichever rank wrote them."""
    url = f"{store.scheme}://models/llama-x{nproc}"
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, "--dtype", "float32", nproc=nproc,
                      env=store.env)
    names = store.download("models", f"llama-x{nproc}", tmp_path / "remote")
    assert ".merger-lock" not in names
    assert_same_files(llama34_local, tmp_path / "remote")  # no part left beside the files either
    assert "uploaded 4 files" in proc.stderr and f"to {url}" in proc.stderr, proc.stderr


def test_one_merge_per_prefix_and_only_an_earlier_merge_is_replaced(store, llama34):
    """The lock object of a merge on another host stops a second merge before it writes; a prefix holding other
    objects is refused and left as it was; an earlier merge is replaced only with --overwrite."""
    holder = {"host": "node-7", "pid": 4242, "kernel": "elsewhere", "start": "1", "started": "earlier",
              "command": "merger merge ...", "token": "theirs"}
    store.put("models", "busy/.merger-lock", json.dumps(holder).encode())
    url = f"{store.scheme}://models/busy"
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, env=store.env, check=False)
    assert proc.returncode == os.EX_TEMPFAIL
    line = single_error_line(proc.stderr)
    assert line.startswith("merger: error: another merge is writing this target (pid 4242 on node-7"), line
    assert line.endswith(f"remove {url}/.merger-lock, {url}"), line
    assert store.names("models", "busy") == [".merger-lock"]

    store.put("models", "notes/readme.txt", b"not a model")
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", f"{store.scheme}://models/notes",
                      env=store.env, check=False)
    assert "target holds objects and no merger output" in single_error_line(proc.stderr)
    assert store.names("models", "notes") == ["readme.txt"]

    url = f"{store.scheme}://models/again"
    run_in_process("merge", "--local_dir", llama34, "--target_dir", url, "--max_shard_size", "20MB", env=store.env)
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, env=store.env, check=False)
    assert single_error_line(proc.stderr) == f"merger: error: target holds an earlier merge: pass --overwrite to " \
                                             f"replace it, {url}"
    run_in_process("merge", "--local_dir", llama34, "--target_dir", url, "--overwrite", env=store.env)
    # the earlier merge's two shards and index are gone: one file now
    assert store.names("models", "again") == ["config.json", "generation_config.json", "merge_manifest.json",
                                              "model.safetensors"]


def test_kill_9_mid_stream_leaves_no_model_and_resume_finishes(store, llama34, tmp_path):
    """Killed after its first batch, once parts are sent: no weight file is whole (rank 0 completes the uploads after
    the last batch), and of the merge only its lock is visible. --resume takes the lock (its holder is gone), removes
    what the killed merge's uploads left (GCS's part objects; Azure's staged blocks, which no later block list names,
    are dropped by Azure itself), sends again what it writes again, and ends with the bytes of a local merge and
    nothing else."""
    local, url, stage = tmp_path / "local", f"{store.scheme}://models/killed", tmp_path / "stage"
    with paused_merge(store.env, llama34, url, stage, tmp_path / "paused",
                      env={"MERGER_TEST_PAUSE_AFTER_BATCH": "0"}) as proc:
        assert store.unfinished("models", "killed")  # mid-upload: parts sent, no file whole
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert visible(store, "killed") == [".merger-lock"]
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", url, "--stage_dir", stage, *STREAMED,
                      "--resume", env=store.env)
    assert "was left by a merge that is gone: taking it" in proc.stderr, proc.stderr
    store.download("models", "killed", tmp_path / "remote")
    run_in_process("merge", "--local_dir", llama34, "--target_dir", local, *STREAMED)
    assert_same_files(local, tmp_path / "remote")  # no lock and no part left either


def test_a_wrong_account_key_is_the_credentials_line(azure_server, llama34):
    """Azurite checks the account key, as Azure does: a wrong one is refused in one line, the key never shown.
    (gcp-storage-emulator checks no credentials: GCS's refusals are tested on reads, tests/test_object_storage.py.)"""
    wrong = "d3Jvbmcga2V5IGZvciB0aGUgdGVzdA=="
    proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "az://models/denied",
                      env={"AZURE_STORAGE_CONNECTION_STRING": azure_server.connection_string(wrong)}, check=False)
    assert proc.returncode == os.EX_NOPERM, proc.stderr
    assert single_error_line(proc.stderr).startswith(
        "merger: error: access denied by the object store (check the credentials"), proc.stderr
    assert wrong not in proc.stderr + proc.stdout
    assert azure_server.names("models", "denied") == []


def test_a_gcs_file_of_more_parts_than_one_compose_takes_is_composed_in_rounds(gcs_server, monkeypatch):
    """GCS composes at most 32 objects a request: a file of 70 parts is composed in rounds (32, 32 and 6, then those
    three) into the parts' bytes in order, and no part or round is left beside it. Small parts stand for PART-sized
    ones (GCS sets no least size): the rounds are what is tested, with the emulator's own compose. Each part is one
    byte repeated, LF and CR among them: a part ending in CR lost that byte when parts went up as gcsfs's
    multipart/related uploads."""
    from merger.io import locations
    from merger.io.object_writers import object_writer

    gcs_server.bucket("models")
    for variable, value in gcs_server.env.items():  # the writer's client finds the emulator as a merge's does
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(locations, "_OBJECT_STORAGES", {})  # a client of this environment, not one made before
    writer = object_writer("gs://models/rounds")
    upload = writer.begin("big.safetensors")
    parts = [bytes([i]) * (1000 + i) for i in range(70)]
    etags = [writer.upload_part("big.safetensors", upload, i + 1, part) for i, part in enumerate(parts)]
    writer.complete("big.safetensors", upload, etags)
    assert gcs_server.names("models", "rounds") == ["big.safetensors"]
    assert gcs_server.bucket("models").blob("rounds/big.safetensors").download_as_bytes() == b"".join(parts)
