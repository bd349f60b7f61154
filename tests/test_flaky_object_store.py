"""Merges from and into a bucket whose store throttles, resets connections, stalls and cuts bodies short: a real
HTTP forwarder on the loopback (tests/helpers/flaky_store.py) injects the faults, at a set rate and reproducibly,
between merger and moto's S3 server; and merges from the GCS emulator and Azurite through the same forwarder (gs://
and az:// are sources only).

Oracle: the same model merged from its local folder with no store in the way (test_bucket_target.py checks that a
merge into a bucket writes those bytes). Through the faults, a merge either writes exactly those bytes, or fails
with one line naming the object, leaving nothing at the target that reads as a model (no config.json, no index,
no manifest, no multipart upload left open), after a bounded number of tries of each request.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from merger.io.store_waits import AZ_ATTEMPTS, AZ_BODY_TRIES, GS_TRIES, S3_ATTEMPTS, S3_REISSUES
from tests.helpers.emulators import SERVERS
from tests.helpers.files import assert_same_files
from tests.helpers.flaky_store import FAULTS, flaky_proxy
from tests.helpers.in_process import single_error_line
from tests.helpers.object_store import download, open_uploads
from tests.helpers.processes import run_merger

pytestmark = [pytest.mark.infra, pytest.mark.slow]

RATE = 0.1  # of the requests of each faulted kind
READ_TIMEOUT = 1  # seconds (MERGER_READ_TIMEOUT): a stall costs this, not the default 20 s
STALL = 3  # seconds a stalled response sends nothing: longer than READ_TIMEOUT
ENTRY_POINTS = {"config.json", "model.safetensors.index.json", "merge_manifest.json"}
# A seed per fault under which RATE faults the merge below at least once (whether a request is faulted depends only
# on the seed and the request, tests/helpers/flaky_store.py)
SEEDS = {"throttle": 1, "reset": 1, "stall": 1, "truncate": 1}
# The sends of one request that merger's waits allow (merger/io/store_waits.py): s3fs's reissues of botocore's
# attempts; gcsfs's tries; azure's body tries, each of its policy's attempts. Each may be sent again at once by aiohttp
# where a kept-alive connection turned out closed (RFC 9112's retry): twice that, at most.
SENDS = {"s3": S3_ATTEMPTS * S3_REISSUES, "gs": GS_TRIES, "az": AZ_BODY_TRIES * AZ_ATTEMPTS}


@pytest.fixture(scope="module")
def store(s3_server):
    for bucket in ("flaky-src", "flaky-out"):
        s3_server.client().create_bucket(Bucket=bucket)
    return s3_server


@pytest.fixture(scope="module")
def source(store, llama34) -> str:
    return store.upload(llama34, "flaky-src", "hf")


@pytest.fixture(scope="module", params=["gs", "az"])
def emulator(request):
    """The GCS emulator and Azurite (a server each, started once per session)."""
    return request.getfixturevalue(SERVERS[request.param])


@pytest.fixture(scope="module")
def emulated_source(emulator, llama34) -> str:
    return emulator.upload(llama34, "flaky-src", "hf")


def through(store, proxy) -> dict[str, str]:
    """The store's environment with its endpoint the proxy's."""
    return {**replace(store, endpoint=proxy.endpoint).env, "MERGER_READ_TIMEOUT": str(READ_TIMEOUT)}


def assert_nothing_finished(store, prefix: str, tmp_path: Path) -> None:
    names = download(store, prefix, tmp_path / "left", bucket="flaky-out")
    assert not ENTRY_POINTS & set(names), names
    assert open_uploads(store, "flaky-out") == []


@pytest.mark.parametrize("fault", FAULTS)
def test_a_merge_from_and_into_a_flaky_bucket_writes_the_unfaulted_bytes(store, source, llama34_local, fault,
                                                                          tmp_path):
    """Each fault at RATE of the object GETs, PutObjects and multipart requests of one bucket-to-bucket merge."""
    with flaky_proxy(store.endpoint, RATE, faults=[fault], seed=SEEDS[fault], stall_s=STALL) as proxy:
        run_merger("merge", "--local_dir", source, "--target_dir", f"s3://flaky-out/{fault}", "--dtype", "float32",
                   env=through(store, proxy))
    assert proxy.injected, f"seed {SEEDS[fault]} faulted none of {dict(proxy.requests)}: choose another"
    download(store, fault, tmp_path / "merged", bucket="flaky-out")
    assert_same_files(llama34_local, tmp_path / "merged")
    assert open_uploads(store, "flaky-out") == []  # none left by a create whose answer was lost


def test_writes_whose_answers_were_lost_are_not_done_twice(store, llama34, llama34_local, tmp_path):
    """The first answer to the lock's conditional create, to CreateMultipartUpload and to CompleteMultipartUpload
    lost after the store acted (a reset): the retried lock create finds the lock its own (not another merge's),
    the upload begun twice leaves none open, the completed upload's retried completion stands."""
    def acted_then_lost(kind: str, path: str) -> bool:
        return kind in ("create_multipart", "complete_multipart") or \
            (kind == "put_object" and path.endswith("/.merger-lock"))

    with flaky_proxy(store.endpoint, 1.0, faults=["reset"], where=acted_then_lost, limit=1) as proxy:
        run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://flaky-out/lost", "--dtype", "float32",
                   env=through(store, proxy))
    assert dict(proxy.injected) == {(kind, "reset"): 1 for kind in ("put_object", "create_multipart",
                                                                     "complete_multipart")}, proxy.injected
    download(store, "lost", tmp_path / "merged", bucket="flaky-out")
    assert_same_files(llama34_local, tmp_path / "merged")  # the lock among them, had it been left
    assert open_uploads(store, "flaky-out") == []


def bounded(proxy, scheme: str = "s3") -> None:
    """No request was sent more than merger's retries allow (SENDS)."""
    assert max(proxy.seen.values()) <= 2 * SENDS[scheme], proxy.seen


def test_a_source_that_always_stalls_is_one_line_after_bounded_tries(store, source, tmp_path):
    with flaky_proxy(store.endpoint, 1.0, faults=["stall"], stall_s=STALL) as proxy:
        proc = run_merger("merge", "--local_dir", source, "--target_dir", tmp_path / "out", check=False,
                          env=through(store, proxy))
    line = single_error_line(proc.stderr)
    assert proc.returncode == os.EX_TEMPFAIL and "Traceback" not in proc.stderr, proc.stderr
    assert f"{source}/" in line and "broke off" in line, line
    bounded(proxy)
    assert list(tmp_path.iterdir()) == []  # neither the target nor its staging folder


def test_a_target_that_always_resets_is_one_line_and_no_model(store, llama34, tmp_path):
    with flaky_proxy(store.endpoint, 1.0, faults=["reset"]) as proxy:
        proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://flaky-out/resets", check=False,
                          env=through(store, proxy))
    line = single_error_line(proc.stderr)
    assert proc.returncode == os.EX_TEMPFAIL and "Traceback" not in proc.stderr, proc.stderr
    assert "s3://flaky-out/resets/" in line and "broke off" in line, line
    bounded(proxy)
    assert_nothing_finished(store, "resets", tmp_path)


def test_a_manifest_that_cannot_be_put_takes_the_entry_points_put_before_it(store, llama34, tmp_path):
    """The weight files' uploads are complete and config.json and the index are put when the manifest's put fails
    for good: those entry points are removed, so the prefix does not read as a model."""
    with flaky_proxy(store.endpoint, 1.0, faults=["throttle"],
                     where=lambda kind, path: path.endswith("/merge_manifest.json") and kind == "put_object") as proxy:
        proc = run_merger("merge", "--local_dir", llama34, "--target_dir", "s3://flaky-out/late",
                          "--max_shard_size", "20MB", check=False, env=through(store, proxy))
    line = single_error_line(proc.stderr)
    assert proc.returncode == os.EX_TEMPFAIL and "Traceback" not in proc.stderr, proc.stderr
    assert "throttling" in line and line.endswith(", s3://flaky-out/late/merge_manifest.json"), line
    bounded(proxy)
    assert_nothing_finished(store, "late", tmp_path)


def test_a_body_shorter_than_asked_is_never_taken_for_the_object(store, source, tmp_path):
    """A store whose ranged GETs answer with fewer bytes than asked and a Content-Length that agrees (nothing the
    HTTP layer can see): merger's own length check names the object."""
    with flaky_proxy(store.endpoint, 1.0, faults=["short"], where=lambda kind, path: path.endswith(".safetensors")
                     ) as proxy:
        proc = run_merger("merge", "--local_dir", source, "--target_dir", tmp_path / "out", check=False,
                          env=through(store, proxy))
    line = single_error_line(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert line.endswith(f"(a response cut short), {source}/model.safetensors"), line
    assert not (tmp_path / "out").exists()


# A seed per store under which RATE faults the merge below: 3 of its 10 GETs from the GCS emulator, 2 of Azurite's
# (which requests are faulted does not depend on the fault)
EMULATED_SEEDS = {"gs": 1, "az": 9}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_merge_from_a_flaky_gcs_or_azure_bucket_writes_the_unfaulted_bytes(emulator, emulated_source,
                                                                           llama34_local, fault, tmp_path):
    seed = EMULATED_SEEDS[emulator.scheme]
    with flaky_proxy(emulator.endpoint, RATE, faults=[fault], seed=seed, stall_s=STALL,
                     store=emulator.scheme) as proxy:
        run_merger("merge", "--local_dir", emulated_source, "--target_dir", tmp_path / "merged", "--dtype", "float32",
                   env=through(emulator, proxy))
    assert proxy.injected, f"seed {seed} faulted none of {dict(proxy.requests)}: choose another"
    assert_same_files(llama34_local, tmp_path / "merged")


@pytest.mark.parametrize("fault,said", [("stall", "broke off"), ("throttle", "kept throttling")])
def test_a_gcs_or_azure_source_that_always_fails_is_one_line_after_bounded_tries(emulator, emulated_source, fault,
                                                                                 said, tmp_path):
    """Every read stalled past the read timeout, or throttled (GCS's 429, Azure's 503 ServerBusy): the line S3's
    stalls and SlowDown give, naming the object, after the tries merger's waits allow."""
    with flaky_proxy(emulator.endpoint, 1.0, faults=[fault], stall_s=STALL, store=emulator.scheme) as proxy:
        proc = run_merger("merge", "--local_dir", emulated_source, "--target_dir", tmp_path / "out", check=False,
                          env=through(emulator, proxy))
    line = single_error_line(proc.stderr)
    assert proc.returncode == os.EX_TEMPFAIL and "Traceback" not in proc.stderr, proc.stderr
    assert f"{emulated_source}/" in line and said in line, line
    bounded(proxy, emulator.scheme)
    assert list(tmp_path.iterdir()) == []


# A seed per store under which RATE faults some of the writes of each fault's merge below (its prefix is in the
# requests a seed draws for): GCS's uploads and a compose; Azure's Put Blob and Put Block
TARGET_SEEDS = {"gs": 3, "az": 9}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_merge_into_a_flaky_gcs_or_azure_bucket_writes_the_unfaulted_bytes(emulator, llama34, llama34_local, fault,
                                                                            tmp_path):
    """A bucket target's writes faulted at RATE (GCS's uploads and composes, Azure's Put Blob, Put Block and Put Block
    List, the lock's conditional create among them): the clients' retries, and the target's rules for a write whose
    answer was lost (a lock found its own, a part sent twice), end with the bytes of a local merge and nothing
    else at the prefix."""
    seed, prefix = TARGET_SEEDS[emulator.scheme], f"flaky-{fault}"
    emulator.bucket("flaky-out")
    with flaky_proxy(emulator.endpoint, RATE, faults=[fault], seed=seed, stall_s=STALL, store=emulator.scheme,
                     where=lambda kind, path: kind != "read") as proxy:
        run_merger("merge", "--local_dir", llama34, "--target_dir", f"{emulator.scheme}://flaky-out/{prefix}",
                   "--dtype", "float32", env=through(emulator, proxy))
    assert proxy.injected, f"seed {seed} faulted none of {dict(proxy.requests)}: choose another"
    emulator.download("flaky-out", prefix, tmp_path / "remote")
    assert_same_files(llama34_local, tmp_path / "remote")
