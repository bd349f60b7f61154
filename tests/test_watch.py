"""`merger watch` on a verl run folder whose steps appear while it runs, as real processes on real FSDP2
checkpoints; the oracle is each step's own weights (save_pretrained's output) and the files' identities.

One watcher sees: a finished step converted; a step saved but not yet named by the tracker left alone; then a
step that fails (a truncated rank file) reported and retried on the next pass once repaired, while the step
beside it is converted. A restarted watcher converts nothing twice, and one killed mid-merge resumes its step."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from merger.watch import finished_steps
from tests.helpers.files import snapshot
from tests.helpers.in_process import command_here
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_merger, start_merger, subprocess_env
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow

SMALL = ["--max_shard_size", "20KB", "--max_inflight", "1"]


def _step(run: Path, n: int, actor: Path) -> Path:
    return Path(shutil.copytree(actor, run / f"global_step_{n}" / "actor"))


def _track(run: Path, n: int) -> None:
    (run / "latest_checkpointed_iteration.txt").write_text(f"{n}\n")


def _wait_for(what, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _wait_paused(pause: Path, proc: subprocess.Popen) -> Path:
    """The pause file of a watcher started through paused_merger.py, once it has paused (removing it lets it go on)."""
    paused = Path(f"{pause}.0")
    deadline = time.monotonic() + 120
    while not (paused.exists() and paused.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return paused


def _identities(folder: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_watch_converts_each_finished_step_once(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", 2)
    run, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "watch.log"
    _step(run, 1, actor)
    _step(run, 2, actor)  # saved, but the tracker still names step 1: not finished
    _track(run, 1)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "merger", "watch", "--local_dir", run, "--target_dir", out,
                                 "--interval", "0.2"], cwd=ROOT, env=subprocess_env(), stderr=err,
                                stdout=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (out / "global_step_1" / "merge_manifest.json").exists(), proc, log)
        time.sleep(1)  # several more passes
        assert sorted(p.name for p in out.iterdir()) == ["global_step_1"]
        first = _identities(out / "global_step_1")

        broken = _step(run, 3, actor)
        rank1 = broken / "model_world_size_2_rank_1.pt"
        rank1.write_bytes(rank1.read_bytes()[:-1000])
        _track(run, 3)  # steps 2 and 3 finished; 3 cannot be read
        _wait_for(lambda: (out / "global_step_2" / "merge_manifest.json").exists()
                  and "watch: global_step_3 failed, retried on the next pass" in log.read_text(), proc, log)
        shutil.copy(actor / rank1.name, rank1)  # repaired: the next pass converts it
        _wait_for(lambda: (out / "global_step_3" / "merge_manifest.json").exists(), proc, log)
        assert _identities(out / "global_step_1") == first  # never converted again
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 130
    for step in (1, 2, 3):
        assert_same_weights(out / f"global_step_{step}", reference, torch.bfloat16)

    # A restarted watcher finds every finished step converted and touches nothing.
    before = {step.name: _identities(step) for step in out.iterdir()}
    again = run_merger("watch", "--local_dir", run, "--target_dir", out, "--once")
    assert "watch: " in again.stderr and "-> " + str(out / "global_step") not in again.stderr
    assert {step.name: _identities(step) for step in out.iterdir()} == before


def test_a_watcher_killed_mid_merge_resumes_the_step(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", 2)
    run, out, pause = tmp_path / "run", tmp_path / "out", tmp_path / "paused"
    _step(run, 1, actor)
    _track(run, 1)
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)}
    proc = start_merger("watch", "--local_dir", run, "--target_dir", out, *SMALL, env=env)
    _wait_paused(pause, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert (out / ".global_step_1.merger-partial").is_dir() and not (out / "global_step_1").exists()
    again = run_merger("watch", "--local_dir", run, "--target_dir", out, *SMALL, "--once")
    assert "--resume: reusing" in again.stderr and "reusing 0 of" not in again.stderr, again.stderr
    assert_same_weights(out / "global_step_1", reference, torch.bfloat16)


def test_two_watchers_on_one_run_convert_each_step_once(fsdp_checkpoint, tmp_path, capsys):
    """Two watchers on one run (two nodes, or a restarted job while the old one still runs): the target lock gives
    each step to one of them, the other says so once and goes on, and both exit 0. The first is paused in the middle
    of step 1 while the second runs, then goes on."""
    actor = fsdp_checkpoint("llama", 2)[0]
    run, out, pause = tmp_path / "run", tmp_path / "out", tmp_path / "paused"
    steps = [f"global_step_{n}" for n in (1, 2, 3)]
    for n in (1, 2, 3):
        _step(run, n, actor)
    _track(run, 3)
    watch = ("watch", "--local_dir", run, "--target_dir", out, "--once", *SMALL)
    first = start_merger(*watch, env={"MERGER_TEST_PAUSE_AFTER_BATCH": "0", "MERGER_TEST_PAUSE_FILE": str(pause)})
    paused = _wait_paused(pause, first)
    second = run_merger(*watch).stderr  # exits 0
    paused.unlink()  # the first goes on
    first_err = first.communicate(timeout=120)[1]
    assert first.returncode == 0, first_err
    assert sorted(p.name for p in out.iterdir()) == steps  # no staging folder or lock left
    for step, by in zip(steps, (first_err, second, second)):
        assert [err.count(f"{step}/actor -> {out / step} (") for err in (first_err, second)] == \
            [int(by is first_err), int(by is second)], (first_err, second)  # converted once, by one watcher
    assert second.count(f"merger: watch: global_step_1 is being converted by another process (pid {first.pid} "
                        f"on {socket.gethostname()}), skipping it") == 1, second
    assert "another process" not in first_err and "failed" not in first_err + second
    merged = tmp_path / "merged"
    assert command_here(capsys, "merge", "--local_dir", run / "global_step_1" / "actor", "--target_dir", merged,
                        *SMALL) == (0, [])
    weights = {n: sha for n, (sha, _, _) in snapshot(merged).items() if n.endswith(".safetensors")}
    for step in steps:
        assert {n: sha for n, (sha, _, _) in snapshot(out / step).items() if n.endswith(".safetensors")} == weights


def test_steps_rotated_away_are_skipped_once(fsdp_checkpoint, tmp_path):
    """A trainer that keeps its last K checkpoints deletes older steps: one deleted while the watcher converts it
    (paused inside its merge) and one deleted before its turn are each said once and skipped, the partial merge
    removed; the step after them is converted, and `--once` exits 0: no step failed."""
    actor = fsdp_checkpoint("llama", 2)[0]
    run, out, pause = tmp_path / "run", tmp_path / "out", tmp_path / "paused"
    for n in (1, 2, 3):
        _step(run, n, actor)
    _track(run, 3)
    proc = start_merger("watch", "--local_dir", run, "--target_dir", out, "--once", *SMALL,
                        env={"MERGER_TEST_PAUSE_AFTER_BATCH": "0", "MERGER_TEST_PAUSE_FILE": str(pause)})
    paused = _wait_paused(pause, proc)  # inside step 1
    assert (out / ".global_step_1.merger-partial").is_dir()
    shutil.rmtree(run / "global_step_1")
    shutil.rmtree(run / "global_step_2")
    paused.unlink()
    _wait_paused(pause, proc).unlink()  # inside step 3
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["global_step_3"]  # step 1's partial merge removed
    rotated = "(rotated away by the trainer: max_actor_ckpt_to_keep, save_total_limit, ...)"
    assert err.count(f"merger: watch: global_step_1 was deleted while it was being converted {rotated}; its partial "
                     f"merge was removed, skipping it") == 1, err
    assert err.count(f"merger: watch: global_step_2 was deleted before its turn {rotated}, skipping it") == 1, err
    assert "failed" not in err and "merger: error" not in err, err
    assert (out / "global_step_3" / "merge_manifest.json").is_file()


@pytest.mark.parametrize("layout, finish, source", [
    ("checkpoint-{n}", lambda step, run: (step / "trainer_state.json").write_text("{}"), "{step}"),
    ("step-{n}", lambda step, run: (step / ".metadata").write_bytes(b""), "{step}"),
    ("iter_{n:07d}", lambda step, run: _track(run, int(step.name[5:])), "{step}"),
    ("global_step_{n}", lambda step, run: _track(run, int(step.name[12:])), "{step}/actor"),
])
def test_each_trainers_mark_of_a_finished_step(tmp_path, layout, finish, source):
    run = tmp_path / "run"
    steps = [run / layout.format(n=n) for n in (5, 10)]
    for step in steps:
        (step / "actor").mkdir(parents=True)
    assert finished_steps(run, "actor") == []
    finish(steps[0], run)
    found = finished_steps(run, "actor")
    assert [(s.number, s.name, s.source) for s in found] == [(5, steps[0].name, Path(source.format(step=steps[0])))]


def test_watch_says_what_it_waits_for(tmp_path, capsys, caplog):
    """Each step folder not finished yet, with the trainer's mark it lacks, said once; with nothing to wait for,
    `--once` says how many steps are converted and what a step folder looks like."""
    caplog.set_level(logging.INFO, logger="merger")
    run = tmp_path / "run"
    for step in ("global_step_2/actor", "iter_0000003", "checkpoint-4", "step-5"):
        (run / step).mkdir(parents=True)
    _track(run, 1)
    code, errors = command_here(capsys, "watch", "--local_dir", run, "--target_dir", tmp_path / "out", "--once")
    assert code == 0 and errors == []
    assert ("merger: watch: waiting for checkpoint-4: no trainer_state.json yet, the Trainer's last file; "
            "global_step_2: latest_checkpointed_iteration.txt says 1; iter_0000003: latest_checkpointed_iteration.txt "
            "says 1; step-5: no .metadata yet, dcp.save's last file") in caplog.messages
    empty = tmp_path / "empty"
    empty.mkdir()
    caplog.clear()
    assert command_here(capsys, "watch", "--local_dir", empty, "--target_dir", tmp_path / "out", "--once") == (0, [])
    assert any(m.startswith(f"merger: watch: 0 steps converted, none being saved in {empty} (its step folders: verl "
                            "global_step_N") for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("given, said", [
    ("run/global_step_1", "this is one saved step, not the run: watch the run folder {run}, or merge the step with "
                          "merger merge"),
    ("run/global_step_1/actor", "this is the actor/ folder of one saved step: watch the run folder {run}"),
    ("actor", "this folder holds a checkpoint, not a run's saved steps: merge it with merger merge"),
])
def test_a_folder_that_is_not_a_run_is_one_line_with_what_to_give(given, said, fsdp_checkpoint, tmp_path, capsys):
    actor = fsdp_checkpoint("llama", 2)[0]
    run = tmp_path / "run"
    _step(run, 1, actor)
    shutil.copytree(actor, tmp_path / "actor")
    code, errors = command_here(capsys, "watch", "--local_dir", tmp_path / given, "--target_dir", tmp_path / "out",
                                "--once")
    assert code == os.EX_NOINPUT and errors == [f"merger: error: {said.format(run=run)}, {tmp_path / given}"]
    assert not (tmp_path / "out").exists()


def test_quantize_applies_to_every_step(fsdp_checkpoint, tmp_path, capsys):
    """A flag that shapes the output reaches each step's merge: the watcher's output is `merge`'s with the same flag
    (which test_fp8_write checks against transformers' own quantizer)."""
    actor = fsdp_checkpoint("llama", 2)[0]
    run = tmp_path / "run"
    _step(run, 1, actor)
    _track(run, 1)
    flags = ("--quantize", "fp8-block")
    assert command_here(capsys, "watch", "--local_dir", run, "--target_dir", tmp_path / "out", "--once",
                        *flags) == (0, [])
    assert command_here(capsys, "merge", "--local_dir", run / "global_step_1" / "actor", "--target_dir",
                        tmp_path / "merged", *flags) == (0, [])
    watched = snapshot(tmp_path / "out" / "global_step_1")
    assert "quantization_config" in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert {n: sha for n, (sha, _, _) in watched.items() if n != "merge_manifest.json"} == \
        {n: sha for n, (sha, _, _) in snapshot(tmp_path / "merged").items() if n != "merge_manifest.json"}
