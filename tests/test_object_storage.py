"""Checkpoints read straight from a bucket (s3://, gs://, az://), against real servers of each protocol on the
loopback: moto's S3 server, gcp-storage-emulator's GCS server and Azurite (Microsoft's Azure Blob emulator).

Oracle: the same checkpoint merged from its local folder, which the DCP and HF tests check against the training
library's own save_pretrained output; a merge from the bucket must write the same bytes. The servers speak their
protocols over HTTP (ranged GETs, listings, ETags), so the client libraries merger uses (s3fs, gcsfs, adlfs) are
exercised as they are against AWS, Google Cloud and Azure. The checkpoints are uploaded with each cloud's own
client (boto3, google-cloud-storage, azure-storage-blob). The cases that hold whatever the store (`any_store`) run
against all three; the formats' own cases against S3 only, as the storage layer under them is the same.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import merger
from merger.catalog import Catalog
from tests.helpers.files import assert_same_files, tmpfs
from tests.helpers.in_process import run_in_process, single_error_line, stdout_in_process
from tests.helpers.emulators import ACCOUNT_KEY, SERVERS
from tests.helpers.object_store import KEY_ID, SECRET, ObjectStore
from tests.helpers.processes import free_port, run_merger, start_merger, subprocess_env
from tests.helpers.weights import assert_same_weights

pytestmark = [pytest.mark.infra, pytest.mark.slow]


@pytest.fixture(scope="module")
def store(s3_server):
    return s3_server


@pytest.fixture(scope="module")
def dcp_in_bucket(store, dcp_root) -> str:
    return store.upload(dcp_root, "ckpt", "runs/dcp")


@pytest.fixture
def own_clients(monkeypatch):
    """Object-store clients made anew, with the environment the test sets: merger keeps one per scheme per process,
    and a merge an earlier test ran in this process made its own with other keys or another endpoint."""
    from merger.io import locations

    monkeypatch.setattr(locations, "_OBJECT_STORAGES", {})


@pytest.fixture(scope="module", params=list(SERVERS))
def any_store(request):
    """Each of the three stores (a server each, started once): the cases that hold whatever the store."""
    return request.getfixturevalue(SERVERS[request.param])


@pytest.fixture(scope="module")
def dcp_in_any_bucket(any_store, dcp_root) -> str:
    return any_store.upload(dcp_root, "ckpt", "runs/dcp")


@pytest.mark.parametrize("nproc", [1, 2])
def test_dcp_from_a_bucket_writes_what_the_local_merge_writes(any_store, dcp_root, dcp_in_any_bucket, nproc,
                                                              tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", dcp_root / "plain", "--target_dir", local)
    proc = run_merger("merge", "--local_dir", f"{dcp_in_any_bucket}/plain", "--target_dir", remote,
                      "--summary_json", tmp_path / "summary.json", nproc=nproc, env=any_store.env)
    assert_same_files(local, remote)
    assert_same_weights(remote, dcp_root / "reference", torch.bfloat16)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["source_dir"] == f"{dcp_in_any_bucket}/plain"
    # each byte of the chunk files fetched about once, read-ahead included; the rest is .metadata and config
    chunk_bytes = sum(p.stat().st_size for p in (dcp_root / "plain").glob("*.distcp"))
    assert chunk_bytes <= sum(summary["fetched_bytes_per_rank"]) <= 1.05 * chunk_bytes + (1 << 20), summary
    for secret in (SECRET, KEY_ID, ACCOUNT_KEY):
        assert secret not in proc.stderr + proc.stdout


def test_nested_dcp_with_its_config_folder_in_the_bucket(store, dcp_root, dcp_in_bucket, tmp_path):
    """accelerate's checkpoint-N/pytorch_model_fsdp_0 found below the URL given, the config from a bucket too."""
    out = tmp_path / "out"
    run_in_process("merge", "--local_dir", f"{dcp_in_bucket}/checkpoint-1", "--target_dir", out,
                   "--hf_model_config_path", f"{dcp_in_bucket}/hf", "--dtype", "keep", env=store.env)
    assert_same_weights(out, dcp_root / "reference", None)
    assert json.loads((out / "config.json").read_text())["model_type"] == \
        json.loads((dcp_root / "hf" / "config.json").read_text())["model_type"]


def test_inspect_and_its_check_from_a_bucket(any_store, dcp_root, dcp_in_any_bucket, capsys):
    """`inspect --check` reads every record from the bucket and checks its CRC-32, as a merge would."""
    url = f"{dcp_in_any_bucket}/plain"
    checked = stdout_in_process(capsys, "inspect", "--local_dir", url, "--check", env=any_store.env)
    files = len(list((dcp_root / "plain").glob("*.distcp")))
    assert f"checked {files} source files" in checked and "all fine" in checked, checked
    described = stdout_in_process(capsys, "inspect", "--local_dir", url, env=any_store.env)
    assert f"root: {url}\n" in described and f"hf_dir: {url}/huggingface\n" in described, described


def test_hf_folder_from_a_bucket(any_store, dcp_root, tmp_path):
    """A HF safetensors folder (the reference save_pretrained wrote) read from a bucket: the same bytes as local."""
    url = any_store.upload(dcp_root / "reference", "ckpt", "runs/hf")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", dcp_root / "reference", "--target_dir", local)
    run_in_process("merge", "--local_dir", url, "--target_dir", remote, env=any_store.env)
    assert_same_files(local, remote)


def test_wrong_credentials_are_one_line_and_never_shown(dcp_root, tmp_path, monkeypatch, own_clients):
    """A server that checks keys, as AWS does (moto's, with no unauthenticated request allowed): ours is unknown."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=subprocess_env({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.1)
        env = {**ObjectStore(f"http://127.0.0.1:{port}").env, "AWS_MAX_ATTEMPTS": "1"}
        url = "s3://ckpt/runs/dcp/plain"
        proc = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", env=env, check=False)
        assert proc.returncode == os.EX_NOPERM
        assert single_error_line(proc.stderr) == (
            f"merger: error: access denied by the object store (check the credentials: AWS_ACCESS_KEY_ID, "
            f"AWS_PROFILE...), {url}")
        debug = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", "--debug", env=env,
                           check=False)
        # a bucket as the target: the same line, not "no such bucket" for a bucket the keys may not see
        target = run_merger("merge", "--local_dir", dcp_root / "plain", "--target_dir", "s3://models/x", env=env,
                            check=False)
        assert target.returncode == os.EX_NOPERM and single_error_line(target.stderr).startswith(
            "merger: error: access denied by the object store (check the credentials"), target.stderr
        for text in (proc.stderr, proc.stdout, debug.stderr, debug.stdout, target.stderr, target.stdout):
            assert SECRET not in text and KEY_ID not in text
        # through the API: the credentials kind, whose line is the command line's
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(merger.CredentialsError) as refused:
            merger.merge(local_dir=url, target_dir=tmp_path / "out")
        assert f"merger: error: {refused.value}" == single_error_line(proc.stderr)
        assert not (tmp_path / "out").exists()
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_missing_bucket_or_folder_is_one_line(any_store, dcp_in_any_bucket, tmp_path):
    for url, said in ((f"{any_store.scheme}://no-such-bucket/x", "checkpoint folder does not exist"),
                      (f"{dcp_in_any_bucket}/no-such-step", "checkpoint folder does not exist")):
        proc = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", env=any_store.env,
                          check=False)
        assert proc.returncode == os.EX_NOINPUT
        assert single_error_line(proc.stderr) == f"merger: error: {said}, {url}"
        assert not (tmp_path / "out").exists()


def test_a_wrong_azure_account_key_is_one_line_and_never_shown(azure_server, dcp_root, tmp_path, monkeypatch,
                                                               own_clients):
    """Azurite checks each request's signature with the account key, as Azure does: a key it does not know is refused
    (403), and said as the credentials' kind, in one line. (The GCS emulator checks no credentials, so gs://'s
    refusal is tested nowhere but in the mapping of gcsfs's 403, which is the same code path as s3fs's.)"""
    url = azure_server.upload(dcp_root / "plain", "ckpt", "runs/keyed")
    wrong = "bWVyZ2VyLXdyb25nLWtleS0wMTIzNDU2Nzg5YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZg=="
    env = {"AZURE_STORAGE_CONNECTION_STRING": azure_server.connection_string(key=wrong)}
    proc = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", env=env, check=False)
    assert proc.returncode == os.EX_NOPERM
    assert single_error_line(proc.stderr) == (
        f"merger: error: access denied by the object store (check the credentials: AZURE_STORAGE_CONNECTION_STRING, "
        f"AZURE_STORAGE_ACCOUNT_KEY...), {url}")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # no warning of adlfs's either
    for text in (proc.stderr, proc.stdout):
        assert wrong not in text and ACCOUNT_KEY not in text
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", env["AZURE_STORAGE_CONNECTION_STRING"])
    with pytest.raises(merger.CredentialsError) as refused:
        merger.merge(local_dir=url, target_dir=tmp_path / "out")
    assert f"merger: error: {refused.value}" == single_error_line(proc.stderr)
    assert not (tmp_path / "out").exists()


def test_an_unreachable_endpoint_is_one_line(dcp_root, tmp_path):
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    proc = run_merger("merge", "--local_dir", "s3://ckpt/runs/dcp/plain", "--target_dir", tmp_path / "out",
                      env=env, check=False, timeout=120)
    assert proc.returncode == 1
    assert single_error_line(proc.stderr) == ("merger: error: cannot reach the object store's endpoint "
                                              "(AWS_ENDPOINT_URL?), s3://ckpt/runs/dcp/plain")


def test_a_read_timeout_that_is_no_number_of_seconds_is_a_usage_line(tmp_path):
    """MERGER_READ_TIMEOUT, and MERGER_S3_READ_TIMEOUT (its older name), bound the reads of every store."""
    for name, url in (("MERGER_READ_TIMEOUT", "gs://ckpt/x"), ("MERGER_S3_READ_TIMEOUT", "az://ckpt/x")):
        proc = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", env={name: "soon"},
                          check=False)
        assert proc.returncode == 2
        assert single_error_line(proc.stderr) == \
            f"merger: error: {name} must be a number of seconds above 0, not 'soon'"


def test_an_azure_source_with_no_account_anywhere_is_the_credentials_line(tmp_path):
    """adlfs, finding no connection string, account or key in the environment, refuses to make its client: merger
    says so as the credentials' kind (before: `unknown storage az://`, the wrong diagnosis)."""
    proc = run_merger("merge", "--local_dir", "az://ckpt/x", "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == os.EX_NOPERM
    assert single_error_line(proc.stderr) == (
        "merger: error: no credentials for the object store (set AZURE_STORAGE_CONNECTION_STRING, "
        "AZURE_STORAGE_ACCOUNT_KEY...), az://ckpt/x")
    assert not (tmp_path / "out").exists()


# gs:// and az:// under torchrun only: one rank reads through the same code, and their servers are the slow ones
@pytest.mark.parametrize("scheme,nproc", [("s3", 1), ("s3", 2), ("gs", 2), ("az", 2)])
def test_verl_fsdp_rank_files_from_a_bucket(request, scheme, fsdp_checkpoint, nproc, tmp_path):
    """torch.save rank files: their pickles and zip directories are fetched, their tensors read in ranges."""
    any_store = request.getfixturevalue(SERVERS[scheme])
    actor, reference = fsdp_checkpoint()
    url = any_store.upload(actor, "ckpt", "runs/fsdp/global_step_1/actor")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", actor, "--target_dir", local)
    run_merger("merge", "--local_dir", url, "--target_dir", remote, "--summary_json", tmp_path / "summary.json",
               nproc=nproc, env=any_store.env)
    assert_same_files(local, remote)
    assert_same_weights(remote, reference, torch.bfloat16)
    rank_bytes = sum(p.stat().st_size for p in actor.glob("model_world_size_*.pt"))
    fetched = sum(json.loads((tmp_path / "summary.json").read_text())["fetched_bytes_per_rank"])
    assert rank_bytes <= fetched <= 1.05 * rank_bytes + (1 << 20)


def test_a_merge_from_a_bucket_leaves_no_local_copy_behind(store, fsdp_checkpoint, tmp_path):
    """The local copy of the bucket's config folder (fetched once) and the sparse shadows of its rank files are
    removed when the `merger` command ends (with os._exit, which runs no atexit handler), not left in $TMPDIR."""
    actor, reference = fsdp_checkpoint()
    url = store.upload(actor, "ckpt", "runs/fsdp_scratch/global_step_1/actor")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = start_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out",
                        env={**store.env, "TMPDIR": str(scratch)})
    made = set()  # the folders seen while it runs (each lives until the end): the merge must make both kinds
    while proc.poll() is None:
        made |= {folder.name for folder in scratch.glob("merger-*")}
        time.sleep(0.01)
    assert proc.returncode == 0, proc.communicate()[1]
    kinds = [name.rsplit("-", 1)[0] for name in made]
    assert kinds.count("merger-fetched") == 1 and set(kinds) == {"merger-fetched", "merger-shadow"}, made
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert not list(scratch.glob("merger-*")), list(scratch.iterdir())


@pytest.mark.parametrize("source", ["rank files", "HF folder"])
def test_a_scratch_folder_with_no_room_is_one_line_naming_it(store, fsdp_checkpoint, dcp_root, source, tmp_path):
    """$TMPDIR with no room (a one-page tmpfs) for merger's local copies of a bucket's files: the shadows of verl's
    rank files, or the config and tokenizer files of an HF folder fetched beside its ranged reads. One line that names
    the object, the copy merger could not write and the scratch folder, with the target's exit code, not a damaged
    source's (a write's ENOSPC names no file: CI's full disk read `no space left on device, unknown file`, and
    torch_load took any OSError for a file it could not load); nothing left at the target or in the scratch folder."""
    if source == "rank files":
        folder, copy = fsdp_checkpoint()[0], "merger-shadow-"
    else:
        folder, copy = dcp_root / "reference", "merger-fetched-"
    url = store.upload(folder, "ckpt", f"runs/no_room/{source.replace(' ', '_')}")
    with tmpfs(tmp_path / "tmp", "size=4k") as scratch:
        proc = run_merger("merge", "--local_dir", url, "--target_dir", tmp_path / "out", check=False,
                          env={**store.env, "TMPDIR": str(scratch)})
        left = list(scratch.iterdir())
    line = single_error_line(proc.stderr)
    assert proc.returncode == 73 and "Traceback" not in proc.stderr, proc.stderr
    assert line.startswith(f"merger: error: no space left on device for the local copy of {url}/"), line
    assert f" in the scratch folder (TMPDIR), {scratch}/{copy}" in line, line
    assert not left and not (tmp_path / "out").exists(), left


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
def test_megatron_from_a_bucket(store, megatron_root, fmt, tmp_path):
    """Megatron-LM save dirs, TP 2 with a GQA bias: torch_dist (a DCP underneath) and legacy mp_rank_*/ .pt files,
    with the HF config folder in the bucket too."""
    case = megatron_root / "tp2_gqa_bias"
    url = store.upload(case, "ckpt", "runs/megatron")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", case / fmt, "--target_dir", local, "--hf_model_config_path", case / "hf")
    run_merger("merge", "--local_dir", f"{url}/{fmt}", "--target_dir", remote, "--hf_model_config_path",
               f"{url}/hf", nproc=2, env=store.env)
    assert_same_files(local, remote)


def test_deepspeed_zero3_from_a_bucket(store, ds_root, tmp_path):
    """DeepSpeed ZeRO-3 fp32 (flat partitions in *_optim_states.pt and the module states file), from a bucket."""
    case = ds_root / "s3_fp32_tied_frozen"
    url = store.upload(case, "ckpt", "runs/deepspeed")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", case / "out", "--target_dir", local, "--hf_model_config_path", case / "hf")
    run_in_process("merge", "--local_dir", f"{url}/out", "--target_dir", remote, "--hf_model_config_path",
                   f"{url}/hf", env=store.env)
    assert_same_files(local, remote)


def test_peft_adapters_into_a_base_model_from_a_bucket(store, adapter_cases, tmp_path):
    """`merger lora`: the base's weights and both adapters read from the bucket, its config fetched."""
    root = adapter_cases / "llama"
    url = store.upload(root, "ckpt", "models/llama")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("lora", "--base", root / "base", "--adapter", root / "patterns", "--adapter", root / "dora",
                   "--target_dir", local)
    run_in_process("lora", "--base", f"{url}/base", "--adapter", f"{url}/patterns", "--adapter", f"{url}/dora",
                   "--target_dir", remote, env=store.env)
    assert_same_files(local, remote)


def test_an_adapter_config_in_a_bucket(store, peft_lora_checkpoint, tmp_path):
    """--adapter_config read from a bucket: the merge equals the one given the local file, whose test checks
    it against PEFT's merge_and_unload."""
    actor, adapter = peft_lora_checkpoint / "global_step_1" / "actor", peft_lora_checkpoint / "reference" / "adapter"
    url = store.upload(adapter, "ckpt", "adapters/fsdp_lora")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", actor, "--target_dir", local, "--adapter_config", adapter)
    run_in_process("merge", "--local_dir", actor, "--target_dir", remote, "--adapter_config", url, env=store.env)
    assert_same_files(local, remote)


def test_quantize_like_a_release_in_a_bucket(store, tmp_path):
    """--quantize_like reads the release's config and safetensors headers from the bucket: the output equals the
    one written like the local release, whose tests check it against transformers' own FP8 quantizer."""
    from tests.writers.fp8_release import write_release

    release = write_release(tmp_path / "release", (16, 16), family="deepseek_v3", reference=tmp_path / "ref")
    url = store.upload(release, "ckpt", "releases/fp8")
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_in_process("merge", "--local_dir", tmp_path / "ref", "--target_dir", local, "--quantize_like", release)
    run_in_process("merge", "--local_dir", tmp_path / "ref", "--target_dir", remote, "--quantize_like", url,
                   env=store.env)
    assert_same_files(local, remote)
    assert any(name.endswith("_scale_inv") for name in json.loads((remote / "model.safetensors").read_bytes()[
        8:8 + int.from_bytes((remote / "model.safetensors").read_bytes()[:8], "little")]))


def test_a_summary_in_a_bucket_is_refused_at_the_flag(tmp_path, dcp_root):
    proc = run_merger("merge", "--local_dir", dcp_root / "plain", "--target_dir", tmp_path / "out", "--summary_json",
                      "s3://out/summary.json", check=False)
    assert proc.returncode == 2
    assert "s3:// paths are not supported here" in proc.stderr and not Path("s3:").exists()


def test_watch_refuses_a_bucket_with_one_line(tmp_path):
    proc = run_merger("watch", "--local_dir", "s3://ckpt/runs", "--target_dir", tmp_path / "hf", "--once",
                      check=False)
    assert proc.returncode == 1
    assert single_error_line(proc.stderr) == (
        "merger: error: merger watch reads a run folder on a local or mounted filesystem, where it learns that a "
        "save completed; merge each step from the bucket with merger merge, s3://ckpt/runs")


def test_an_object_rewritten_after_planning_is_found(any_store, dcp_root, monkeypatch, tmp_path, own_clients):
    """The identity a merge checks at its end: an object's ETag (GCS: its generation too) changes with a rewrite of
    the same size."""
    from merger.output.source_identity import check_unchanged, source_identity
    from merger.sources import open_catalog
    from merger.errors import MergerError
    from merger.io import location

    for key, value in any_store.env.items():
        monkeypatch.setenv(key, value)
    url = any_store.upload(dcp_root / "plain", "ckpt", "runs/rewritten")
    catalog: Catalog = open_catalog(location(url))
    before = source_identity(catalog)
    check_unchanged(catalog, before)  # nothing changed yet
    name = catalog.files[0].removeprefix(f"{url}/")
    body = bytearray((dcp_root / "plain" / name).read_bytes())
    body[-1] ^= 1
    (tmp_path / "changed" / name).parent.mkdir(parents=True)
    (tmp_path / "changed" / name).write_bytes(body)
    any_store.upload(tmp_path / "changed", "ckpt", "runs/rewritten")
    with pytest.raises(MergerError, match=r"a source file changed while it was being merged \(its etag(, version)? changed\)"):
        check_unchanged(catalog, before)


def test_reads_along_the_plan_fetch_each_byte_once(store, monkeypatch):
    """One rank reading two files whose pieces its output order interleaves, as a DCP merge of two ranks' files
    does (each file's second half, then each file's first half; each range's last bytes first, as zipfile reads a
    blob's directory, then front to back a megabyte at a time). With the ranges said first (what the engine does
    for every batch), every byte is fetched once, and the reads hold the objects' bytes: oracle, the bytes put."""
    import os

    from merger.io.object_store import HELD, ObjectStorage

    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    half = 20 << 20  # the two files together outgrow what a rank holds (HELD)
    bodies = {f"plan/run/{name}": os.urandom(2 * half) for name in ("a.distcp", "b.distcp")}
    assert sum(len(b) for b in bodies.values()) > HELD
    client = store.client()
    client.create_bucket(Bucket="plan")
    for key, body in bodies.items():
        client.put_object(Bucket="plan", Key=key.removeprefix("plan/"), Body=body)
    ranges = [(key, start, start + half) for start in (half, 0) for key in bodies]
    storage = ObjectStorage("s3", "s3://plan/run")
    storage.will_read(ranges)
    for key, start, end in ranges:
        tail = bytearray(22)
        assert storage.read_into(key, memoryview(tail), end - 22) == 22
        assert tail == bodies[key][end - 22:end]
        got = bytearray(end - start)
        for at in range(start, end, 1 << 20):
            storage.read_into(key, memoryview(got)[at - start:at - start + (1 << 20)], at)
        assert got == bodies[key][start:end]
    assert storage.fetched == sum(len(b) for b in bodies.values())


def test_a_blob_larger_than_a_fetch_read_from_its_end_first(store, monkeypatch):
    """A DCP blob larger than one fetch (32 MiB) is read as zipfile and the merge read it: its last bytes (the zip
    directory) first, then front to back. Its bytes are fetched about once (the directory's 64 KiB twice at most),
    and what is read is the object's bytes: oracle, the bytes put."""
    import os

    from merger.io.object_store import FETCH, ObjectStorage

    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    body = os.urandom(FETCH + (8 << 20))
    client = store.client()
    client.create_bucket(Bucket="blob")
    client.put_object(Bucket="blob", Key="run/__0_0.distcp", Body=body)
    storage = ObjectStorage("s3", "s3://blob/run")
    key = "blob/run/__0_0.distcp"
    storage.will_read([(key, 0, len(body))])
    tail = bytearray(22)
    assert storage.read_into(key, memoryview(tail), len(body) - 22) == 22 and tail == body[-22:]
    got = bytearray(len(body))
    for at in range(0, len(body), 1 << 20):
        storage.read_into(key, memoryview(got)[at:at + (1 << 20)], at)
    assert got == body
    assert len(body) <= storage.fetched <= len(body) + (64 << 10) + 22
