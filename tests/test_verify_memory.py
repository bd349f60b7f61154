"""`merge --verify`, and the check of a config that ties the embeddings, stream under the merge's own batch
budget (issue #35, items 4 and 1).

A 364 MB fp32 FSDP2 checkpoint (benchmarks/build_checkpoint.py: 2 rank files, a 131 MB embedding and lm_head
each) merged on 1 rank with `--dtype keep --max_inflight 16MiB`, with and without `--verify`: the peak RSS the
summary reports (getrusage, the kernel's count) may grow by a few chunks with verify, never by a tensor. When
verify assembled every tensor whole and read the written one whole beside it, it grew by 2 x 131 MB.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.files import removed_after
from tests.helpers.paths import ROOT
from tests.helpers.processes import run, run_merger, torchrun_cmd

pytestmark = pytest.mark.slow

MiB = 1 << 20
MARGIN = 48 * MiB  # a few 1 MiB chunks and allocator slack; the checkpoint is 364 MB, its largest tensor 131 MB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Iterator[Path]:
    with removed_after(tmp_path_factory.mktemp("verify_memory")) as folder:
        run(torchrun_cmd(2) + [str(ROOT / "benchmarks" / "build_checkpoint.py"), "--out", str(folder / "actor"),
                               "--layers", "2", "--hidden", "1024", "--format", "fsdp"], timeout=600)
        yield folder / "actor"


def _peak(actor: Path, root: Path, *extra) -> int:
    summary = root / "summary.json"
    run_merger("merge", "--local_dir", actor, "--target_dir", root / "out", "--dtype", "keep", "--max_inflight",
               "16MiB", "--summary-json", summary, *extra, timeout=600)
    report = json.loads(summary.read_text())
    assert report["status"] == "ok" and (report["verify"] or {}).get("ok", True)
    return max(report["peak_rss_bytes_per_rank"])


@pytest.fixture(scope="module")
def plain(checkpoint, tmp_path_factory) -> int:
    """The peak of the merge every test compares with, merged once (the merged model is not kept)."""
    with removed_after(tmp_path_factory.mktemp("plain")) as folder:
        return _peak(checkpoint, folder)


def test_verify_peak_stays_near_the_merge_peak(checkpoint, plain, tmp_path):
    nbytes = sum(f.stat().st_size for f in checkpoint.glob("model_world_size_*.pt"))
    assert nbytes > 300 * 10**6
    verified = _peak(checkpoint, tmp_path / "verified", "--verify")
    assert verified - plain < MARGIN, (plain / MiB, verified / MiB)


def test_checking_a_tie_the_config_claims_stays_near_the_merge_peak(checkpoint, plain, tmp_path):
    """The same checkpoint under a config that ties the embeddings: both 131 MB tensors are read and compared
    before the plan is fixed (they differ: both are written), a chunk at a time, never a batch of them."""
    lying = tmp_path / "actor"
    lying.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file():
            (lying / f.name).symlink_to(f)
    shutil.copytree(checkpoint / "huggingface", lying / "huggingface")
    config = json.loads((lying / "huggingface" / "config.json").read_text())
    (lying / "huggingface" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    checked = _peak(lying, tmp_path / "checked")
    assert json.loads((tmp_path / "checked" / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert checked - plain < MARGIN, (plain / MiB, checked / MiB)


# A trainer that holds 2 GiB, then runs merger in its place (exec), as a job script or a launcher may.
BALLAST_THEN_MERGER = """
import os, sys
ballast = bytearray(2 << 30)
for page in range(0, len(ballast), 4096):
    ballast[page] = 1  # touched: resident
os.execv(sys.executable, [sys.executable, "-m", "merger", *sys.argv[1:]])
"""


def test_the_peak_reported_is_the_merge_own_not_what_started_it(checkpoint, plain, tmp_path):
    """Linux carries getrusage's ru_maxrss across exec: a merge started in place of a 2 GiB process reported the
    2 GiB as its own peak. The peak it reports is the one a merge started afresh reports (the kernel's high-water
    mark of the merge's own address space)."""
    summary = tmp_path / "summary.json"
    run([sys.executable, "-c", BALLAST_THEN_MERGER, "merge", "--local_dir", str(checkpoint), "--target_dir",
         str(tmp_path / "exec"), "--dtype", "keep", "--max_inflight", "16MiB", "--summary-json", str(summary)],
        timeout=600)
    after_exec = max(json.loads(summary.read_text())["peak_rss_bytes_per_rank"])
    assert plain < (1 << 30) and abs(after_exec - plain) < 4 * MARGIN, (plain / MiB, after_exec / MiB)
