"""Failure behaviour: bad input, failing and killed ranks, full disks, --resume and hostile files.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder and then damaged there: truncated, overwritten, deleted, replaced.
The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and the
processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (PAUSED_MERGER, ROOT, _env, assert_same_weights, flip_bit_in_tensor, merge_here, run, run_merger,
                      single_error_line, snapshot, start_merger, start_ranks, torchrun_cmd)
from merger.cli import main
from merger.output.resume import CHECKSUM_BLOCK, deal_blocks

WORLD = 2
RANK0, RANK1 = (f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD))
# Several output files and one step per batch, so a merge can be stopped between finished files.
SMALL = ["--max_shard_size", "20KB", "--max_inflight", "1"]
SMALL_BLOCKS_MERGER = ROOT / "tests" / "small_blocks_merger.py"


@pytest.fixture(scope="module")
def pristine(fsdp_checkpoint):
    return fsdp_checkpoint("llama", WORLD)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private copy of the real checkpoint, for the test to damage."""
    return Path(shutil.copytree(pristine[0], tmp_path / "src" / "actor"))


@pytest.fixture
def reference(pristine) -> Path:
    return pristine[1]


def assert_nothing_written(parent: Path, before: set[str]) -> None:
    """No model, no staging folder, nothing new beside the target."""
    assert {p.name for p in parent.iterdir()} == before


def _delete_rank1(c):
    (c / RANK1).unlink()


def _truncate(name):
    def damage(c):
        data = (c / name).read_bytes()
        (c / name).write_bytes(data[: len(data) // 2])
    return damage


def _random_bytes(c):
    (c / RANK1).write_bytes(os.urandom((c / RANK1).stat().st_size))


def _world_size_lie(c):
    (c / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))


def _rank0_as_rank1(c):
    # Both files are real; rank 0's shards of the 101-row embedding have 51 rows, rank 1's should have 50.
    shutil.copyfile(c / RANK0, c / RANK1)


def _no_rank_files(c):
    for f in c.glob("model_world_size_*"):
        f.unlink()


def _no_config(c):
    (c / "huggingface" / "config.json").unlink()


def _no_hf_dir(c):
    shutil.rmtree(c / "huggingface")


def _rank1_unreadable(c):
    (c / RANK1).unlink()
    (c / RANK1).mkdir()  # root reads any file, so "unreadable" is a path that cannot be read as a file


def _config_links_out(c):
    secret = c.parent / "config.json"
    shutil.move(c / "huggingface" / "config.json", secret)
    (c / "huggingface" / "config.json").symlink_to(secret)


BAD_INPUT = {
    "missing rank file": (_delete_rank1, "missing", RANK1),
    "truncated rank 0": (_truncate(RANK0), "cannot load rank file", RANK0),
    "truncated rank 1": (_truncate(RANK1), "cannot load rank file", RANK1),
    "random bytes": (_random_bytes, "cannot load rank file: not a torch.save file", RANK1),
    "world size contradicted": (_world_size_lie, "world_size 4", "fsdp_config.json"),
    "shards disagree across ranks": (_rank0_as_rank1, "local shape", RANK1),
    "unknown layout": (_no_rank_files, "no known checkpoint layout", "actor"),
    "missing config": (_no_config, "no config.json", "huggingface"),
    "missing HF folder": (_no_hf_dir, "no HF config folder", "actor"),
    "unreadable rank file": (_rank1_unreadable, "cannot load rank file", RANK1),
    "config.json links out of the folder": (_config_links_out, "no config.json", "huggingface"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_before_any_output(case, ckpt, tmp_path, capsys):
    damage, what, file = BAD_INPUT[case]
    damage(ckpt)
    source = snapshot(ckpt)
    out = tmp_path / "out"
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out / "model")
    assert code == 1
    assert len(errors) == 1 and what in errors[0] and file in errors[0].rsplit(", ", 1)[1], errors
    assert not out.exists()  # not even the target's parent: every check ran before anything was created
    assert snapshot(ckpt) == source


def test_source_that_is_not_a_folder(ckpt, tmp_path, capsys):
    code, errors = merge_here(capsys, "--local_dir", ckpt / RANK0, "--target_dir", tmp_path / "out")
    assert code == 1 and errors == [f"merger: error: checkpoint path is not a folder, {ckpt / RANK0}; pass the folder "
                                    f"that holds it: --local_dir {ckpt}"]


@pytest.mark.parametrize("target", ["parent is a file", "target is a file", "target not empty"])
def test_target_that_cannot_be_written(target, ckpt, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    if target == "parent is a file":
        blocker.write_text("x")
        out, named = blocker / "model", blocker
    elif target == "target is a file":
        blocker.write_text("x")
        out = named = blocker
    else:
        blocker.mkdir()
        (blocker / "keep.txt").write_text("user data")
        out = named = blocker
    before, source = {p.name for p in tmp_path.iterdir()}, snapshot(ckpt)
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 1 and len(errors) == 1 and errors[0].endswith(f", {named}"), errors
    assert_nothing_written(tmp_path, before)
    assert snapshot(ckpt) == source
    assert target != "target not empty" or (blocker / "keep.txt").read_text() == "user data"


def test_code_running_pickle_is_refused(ckpt, tmp_path, capsys):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    for victim in (RANK0, RANK1):  # rank 0 is read for the catalog, rank 1 only by the file check
        original = (ckpt / victim).read_bytes()
        torch.save({"model.embed_tokens.weight": Payload()}, ckpt / victim)
        code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", tmp_path / "out")
        assert code == 1 and len(errors) == 1, errors
        assert "refusing to load rank file" in errors[0] and "system" in errors[0] and errors[0].endswith(victim)
        assert not marker.exists() and not (tmp_path / "out").exists()
        if victim == RANK0:
            (ckpt / victim).write_bytes(original)
    # The payload is live: an unrestricted unpickler runs it. Proves the assertion above means something.
    torch.load(ckpt / RANK1, weights_only=False)
    assert marker.exists()


def test_links_out_of_the_hf_folder_are_not_copied(ckpt, reference, tmp_path, capsys):
    hf = ckpt / "huggingface"
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT")
    (hf / "special_tokens_map.json").symlink_to(secret)  # a link out: never followed
    (hf / "extra_dir").symlink_to(tmp_path)  # a link to a folder: never followed
    (hf / "chat_template.jinja").symlink_to(hf / "tokenizer_config.json")  # a link inside the folder: fine
    out = tmp_path / "out"
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out)
    assert code == 0, errors
    names = {p.name for p in out.iterdir()}
    assert "special_tokens_map.json" not in names and "extra_dir" not in names
    assert not (out / "chat_template.jinja").is_symlink()
    assert (out / "chat_template.jinja").read_bytes() == (hf / "tokenizer_config.json").read_bytes()
    assert not any(b"SECRET-CONTENT" in p.read_bytes() for p in out.iterdir())
    assert_same_weights(out, reference, torch.bfloat16)


def test_hub_token_is_never_printed(ckpt, tmp_path, monkeypatch, capsys, caplog):
    token = "hf_FAKEtoken0123456789abcdefABCDEF"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(var, token)
    ok = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", "--debug", "--log_level", "DEBUG")
    assert token not in ok.stdout + ok.stderr
    assert not any(token.encode() in p.read_bytes() for p in (tmp_path / "out").iterdir())
    caplog.set_level(logging.DEBUG)
    (ckpt / RANK1).write_bytes(b"garbage")  # and a failure, with --debug's traceback
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "out2"), "--debug"]) == 1
    captured = capsys.readouterr()
    assert "merger: error:" in captured.err and token not in captured.out + captured.err + caplog.text


def _merge_into_tmpfs(capsys, tmp_path, mount_options: str, *args) -> tuple[int, list[str], Path, list[str]]:
    """Merge into `model` on a fresh tmpfs mounted with `mount_options`; returns the exit code, the error lines,
    the mount point and what the merge left there."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", mount_options, "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        code, errors = merge_here(capsys, *args, "--target_dir", mnt / "model")
        return code, errors, mnt, sorted(p.name for p in mnt.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_read_only_target(ckpt, tmp_path, capsys):
    # A read-only filesystem refuses even root, unlike file permissions.
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "ro,size=1m", "--local_dir", ckpt)
    assert code == 1 and errors == [f"merger: error: target's parent folder is not writable, {mnt}"]
    assert left == []


@pytest.mark.parametrize("keep", [False, True])
def test_disk_full_while_writing(keep, ckpt, tmp_path, capsys, caplog):
    # 64 KiB holds the 54 KiB of weights (the free-space check passes) but not the config and tokenizer too.
    caplog.set_level(logging.INFO, logger="merger")
    source = snapshot(ckpt)
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "size=64k", "--local_dir", ckpt,
                                                *(["--keep-partial"] if keep else []))
    assert code == 1 and len(errors) == 1 and "no space left on device" in errors[0].lower(), errors
    assert str(mnt / ".model.merger-partial") in errors[0]
    assert left == ([".model.merger-partial"] if keep else [])  # never a `model` folder
    assert ("kept the partial merge" in caplog.text) == keep
    assert snapshot(ckpt) == source


def test_not_enough_free_space_is_refused_up_front(ckpt, tmp_path, capsys):
    code, errors, mnt, left = _merge_into_tmpfs(capsys, tmp_path, "size=16k", "--local_dir", ckpt)
    assert code == 1 and len(errors) == 1 and "not enough free space" in errors[0], errors
    assert left == []


def _file_size_limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write returns EFBIG instead of killing the process


def test_file_size_limit(ckpt, tmp_path):
    source = snapshot(ckpt)
    out = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", out / "model", check=False,
                      preexec_fn=_file_size_limit)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "file too large" in errors[0].lower() and str(out / ".model.merger-partial") in errors[0]
    assert list(out.iterdir()) == []
    assert snapshot(ckpt) == source


def test_error_on_one_rank_stops_every_rank(ckpt, tmp_path):
    # Only merge rank 1 of 2 opens rank file 1; rank 0 must not wait for it forever.
    (ckpt / RANK1).write_bytes(os.urandom(4096))
    started = time.monotonic()
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", "--dist_timeout", "60",
                      nproc=2, check=False, timeout=120)
    assert time.monotonic() - started < 90
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode != 0
    # One line (rank 0 prints it for the whole job), naming the failing rank and its file.
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("merger: error: rank 1: cannot load rank file") and errors[0].endswith(str(ckpt / RANK1))
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / ".out.merger-partial").exists()


def test_torchrun_report_names_the_error_as_root_cause(ckpt, tmp_path):
    """torchrun ends a failed job with its own report: it must show merger's line, read from the error record
    (TORCHELASTIC_ERROR_FILE) each failing rank wrote, not `error_file: <N/A>`."""
    (ckpt / RANK0).write_bytes(b"")
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", nproc=2, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert "cannot load rank file: the file is empty" in errors[0] and errors[0].endswith(str(ckpt / RANK0))
    report = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {errors[0]}" in report, proc.stderr
    assert "error_file: <N/A>" not in proc.stderr and "error_file: /" in report


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _start(launch: str, args: list, nproc: int, env: dict | None = None, wrap: dict | None = None
           ) -> list[subprocess.Popen]:
    """A merge under torchrun (one process: the agent), or as plain env:// ranks (one process each)."""
    if launch == "torchrun":
        return [start_merger(*args, nproc=nproc, env=env)]
    return start_ranks(*args, nproc=nproc, env=env, wrap=wrap)


def _wait_all(procs: list[subprocess.Popen], args) -> tuple[subprocess.CompletedProcess, float]:
    """Wait for every process; their exit status (the first failure's) and stderr together, and the
    seconds until the last one ended."""
    started = time.monotonic()
    outs = [p.communicate(timeout=120) for p in procs]
    took = time.monotonic() - started
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in outs), "".join(e for _, e in outs)), took


def _kill_rank_mid_merge(ckpt: Path, out: Path, tmp_path: Path, *extra, nproc: int = 2, victim: int = 1,
                         after_batch: int = 12, pause_all: bool = True, launch: str = "torchrun"
                         ) -> tuple[subprocess.CompletedProcess, float, int]:
    """Start a real merge, let it pause after `after_batch` (test hook), SIGKILL one rank, wait for the end.
    Returns what the processes said, the seconds from the kill until every process ended, and the pid killed.

    With pause_all=False only the victim pauses: the other ranks are inside a collective when it dies.
    """
    pause = tmp_path / "paused"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": str(after_batch), "MERGER_TEST_PAUSE_FILE": str(pause)}
    if not pause_all:
        env["MERGER_TEST_PAUSE_RANK"] = str(victim)
    args = ["merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, *extra]
    procs = _start(launch, args, nproc, env)
    files = [Path(f"{pause}.{r}") for r in (range(nproc) if pause_all else [victim])]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _wait_all(procs, args)
        time.sleep(0.2)
    workers = [w for p in procs for w in _children(p.pid)]
    killed = int(Path(f"{pause}.{victim}").read_text())
    os.kill(killed, signal.SIGKILL)
    proc, took = _wait_all(procs, args)
    assert not any(_alive(p) for p in workers)
    return proc, took, killed


def _children(pid: int) -> list[int]:
    """The worker processes torchrun started (or the merge process itself, without torchrun)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids] or [pid]


def _lost_line(rank: int, pid: int) -> str:
    return (f"merger: error: rank {rank} was lost: its process (pid {pid} on {socket.gethostname()}) ended; "
            f"every other rank stopped")


# Within 15 s of the kill every rank has ended: one line names the lost rank, the staging folder is gone (or
# kept). Asleep, the survivors sit in Python (under torchrun its agent's SIGTERM reaches them; without it only
# the peer watch does); in a collective they sit in gloo's C++. Rank 0 hosts the store under plain env://;
# when it is lost, rank 1 keeps or removes the staging folder and prints the line, rank 2 stays silent.
LOST_RANK = {  # launch, lost rank, all ranks paused, --keep-partial, ranks
    "torchrun, peers in a collective": ("torchrun", 1, False, False, 2),
    "torchrun, peers asleep": ("torchrun", 1, True, False, 2),
    "torchrun, rank 0 lost, keep partial": ("torchrun", 0, False, True, 2),
    "env, peers in a collective": ("env", 1, False, False, 2),
    "env, peers asleep": ("env", 1, True, False, 2),
    "env, rank 0 lost, keep partial": ("env", 0, True, True, 3),
}


@pytest.mark.parametrize("case", list(LOST_RANK))
def test_killed_rank_ends_the_job_and_cleans_up(case, ckpt, tmp_path):
    launch, victim, pause_all, keep, nproc = LOST_RANK[case]
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    proc, took, killed = _kill_rank_mid_merge(ckpt, out, tmp_path, *(["--keep-partial"] if keep else []),
                                              after_batch=3, pause_all=pause_all, launch=launch, victim=victim,
                                              nproc=nproc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert errors == [_lost_line(victim, killed)], proc.stderr
    assert launch == "env" or "SIGKILL" in proc.stderr  # torchrun's root cause: the same rank
    assert not out.exists()
    assert stage.is_dir() == keep, proc.stderr
    assert not keep or (stage / "merge_manifest.json").is_file() and "kept the partial merge" in proc.stderr


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of merge rank `rank` among the processes started by `launcher` (torchrun, unshare) or itself."""
    for pid in [*_children(launcher), launcher]:
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if f"RANK={rank}".encode() in env and (b"-m\0merger" in cmdline or bytes(PAUSED_MERGER) in cmdline):
                return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


@pytest.mark.parametrize("launch", ["torchrun", "env"])
def test_rank_killed_during_an_exchange(launch, fsdp_checkpoint, tmp_path):
    # No test hook: the merge runs freely. Once its staging folder exists, rank 1 is stopped: its peer goes on
    # into the next collective and waits there. Then rank 1 is killed.
    ckpt = fsdp_checkpoint("llama", WORLD, extra=("--layers", "6", "--hidden", "64"))[0]
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    args = ["merge", "--local_dir", ckpt, "--target_dir", out, *SMALL]
    procs = _start(launch, args, WORLD)
    deadline = time.monotonic() + 120
    while not stage.exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _wait_all(procs, args)
        time.sleep(0.01)
    victim = _rank_pid(procs[0].pid, 1) if launch == "torchrun" else procs[1].pid
    os.kill(victim, signal.SIGSTOP)
    time.sleep(1)
    assert all(p.poll() is None for p in procs) and stage.exists() and not out.exists()
    os.kill(victim, signal.SIGKILL)
    proc, took = _wait_all(procs, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert errors == [_lost_line(1, victim)], proc.stderr
    assert not out.exists() and not stage.exists()


def test_silent_rank_is_lost_by_its_heartbeat(ckpt, tmp_path):
    # Rank 1 runs in a pid namespace of its own, as if on another host: rank 0 cannot see its process, only
    # its heartbeats. Stopped (a frozen node: no socket closes, gloo waits for the full --dist_timeout), it
    # beats no more, and rank 0, stuck in a collective, ends within the staleness threshold.
    from merger.engine.peer_watch import PERIOD_S, STALE_BEATS

    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare needs CAP_SYS_ADMIN)")
    pause = tmp_path / "paused"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause), "MERGER_TEST_PAUSE_RANK": "1"}
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL, "--dist_timeout", "300"]
    procs = start_ranks(*args, nproc=WORLD, env=env, wrap={1: unshare})
    deadline = time.monotonic() + 120
    while not (Path(f"{pause}.1").exists() and Path(f"{pause}.1").read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _wait_all(procs, args)
        time.sleep(0.2)
    victim = _rank_pid(procs[1].pid, 1)
    os.kill(victim, signal.SIGSTOP)
    started = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        os.kill(victim, signal.SIGKILL)
        procs[1].communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("merger: error:")]
    assert errors == [f"merger: error: rank 1 was lost: no heartbeat from it on {socket.gethostname()} for "
                      f"{STALE_BEATS} beats of {PERIOD_S:g} s; every other rank stopped"], err
    assert procs[0].returncode == 1
    # The verdict needs STALE_BEATS missed beats, not less; then the end is quick (not the 300 s timeout).
    assert STALE_BEATS * PERIOD_S * 0.9 - PERIOD_S < took < STALE_BEATS * PERIOD_S + 15, took
    assert not (tmp_path / ".out.merger-partial").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("launch", ["torchrun", "env"])
def test_sigterm_reaches_a_rank_waiting_in_a_collective(launch, ckpt, tmp_path):
    # scancel, or torchrun stopped: every rank gets SIGTERM. Rank 1 sits in Python and handles it; rank 0 waits
    # in gloo's C++ for rank 1, where its Python handler cannot run. Both must end, clean up and say why.
    pause = tmp_path / "paused"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause), "MERGER_TEST_PAUSE_RANK": "1"}
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL]
    procs = _start(launch, args, WORLD, env)
    deadline = time.monotonic() + 120
    while not (Path(f"{pause}.1").exists() and Path(f"{pause}.1").read_text()):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _wait_all(procs, args)
        time.sleep(0.2)
    time.sleep(1)  # rank 0 is in the next collective by now
    for p in procs:
        p.send_signal(signal.SIGTERM)  # torchrun's agent passes it on to its workers
    proc, took = _wait_all(procs, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert took < 15 and proc.returncode != 0, (took, proc.stderr)
    assert sorted(errors) == [f"merger: error: interrupted by SIGTERM (rank {r})" for r in range(WORLD)], proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()


def test_ranks_that_finish_leave_without_a_word(ckpt, reference, tmp_path):
    # Plain env:// ranks: rank 0's store goes away with it when it is done; no rank may take that for a loss.
    args = ["merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", *SMALL]
    proc, _ = _wait_all(start_ranks(*args, nproc=WORLD), args)
    assert proc.returncode == 0 and "merger: error" not in proc.stderr, proc.stderr
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


def block_sha256(path: Path, block: int) -> list[str]:
    """hashlib's sha256 of each `block` bytes of the file, the last piece shorter: the manifest's oracle."""
    data = path.read_bytes()
    return [hashlib.sha256(data[start:start + block]).hexdigest() for start in range(0, len(data), block)]


def test_every_rank_checksums_its_share_of_the_files(ckpt, tmp_path):
    """3 ranks share the read-back hashing; rank 0's manifest ends up with the sha256 of every 256 MiB block of
    every file (one block each here) as hashlib computes it over the finished files."""
    out = tmp_path / "out"
    run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, nproc=3)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    files = manifest["output_files"]
    assert len(files) > 3 and manifest["checksum_block_bytes"] == 256 << 20
    assert {name: info["sha256_blocks"] for name, info in files.items()} == {
        name: block_sha256(out / name, 256 << 20) for name in files}


def test_one_file_is_hashed_by_every_rank(ckpt, tmp_path):
    """One output file, 2 ranks, 2000-byte checksum blocks (tests/small_blocks_merger.py sets merger's block
    size; the real one is 256 MiB): each block's sha256 is hashlib's over those bytes of the finished file, and
    each rank read back and hashed half of the file, give or take a block."""
    out, hashed, block = tmp_path / "out", tmp_path / "hashed", 2000
    env = {"MERGER_TEST_CHECKSUM_BLOCK": str(block), "MERGER_TEST_HASHED": str(hashed)}
    run(torchrun_cmd(2) + [str(SMALL_BLOCKS_MERGER), "merge", "--local_dir", str(ckpt), "--target_dir", str(out),
                           "--max_inflight", "1"], env=env)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert list(manifest["output_files"]) == ["model.safetensors"] and manifest["checksum_block_bytes"] == block
    size = (out / "model.safetensors").stat().st_size
    assert size > 10 * block
    assert manifest["output_files"]["model.safetensors"]["sha256_blocks"] == block_sha256(out / "model.safetensors",
                                                                                         block)
    per_rank = [int(Path(f"{hashed}.{rank}").read_text()) for rank in range(2)]
    assert sum(per_rank) == size and abs(per_rank[0] - per_rank[1]) <= block, per_rank


@pytest.mark.parametrize("sizes, world", [
    ([10 * CHECKSUM_BLOCK + 3], 2), ([10 * CHECKSUM_BLOCK + 3], 3),  # one file
    ([CHECKSUM_BLOCK + 1] * 8, 2),  # every file a full block and a 1-byte one: round-robin would split 8:1
    ([CHECKSUM_BLOCK // 2] * 5 + [7 * CHECKSUM_BLOCK], 4), ([3 * CHECKSUM_BLOCK] * 2, 8)])  # ranks to spare
def test_checksum_blocks_are_dealt_evenly(sizes, world):
    """Every block of every file to exactly one rank, and no rank more than one block's bytes ahead of any other."""
    shares = deal_blocks(list(enumerate(sizes)), CHECKSUM_BLOCK, world)
    blocks = [(i, k) for i, size in enumerate(sizes) for k in range(-(-size // CHECKSUM_BLOCK))]
    assert sorted(pair for share in shares for pair in share) == blocks
    nbytes = [sum(min(CHECKSUM_BLOCK, sizes[i] - k * CHECKSUM_BLOCK) for i, k in share) for share in shares]
    assert sum(nbytes) == sum(sizes) and max(nbytes) - min(nbytes) <= CHECKSUM_BLOCK, nbytes
    assert sum(1 for share in shares if share) == min(world, len(blocks))


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file, read from its header as the format defines it."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    return {name: (8 + length + info["data_offsets"][0], 8 + length + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


# How a block's bytes become known written: this rank wrote them, every rank did (a batch confirmed at a sync
# point, on one host), or every rank did and the file's last batch is confirmed (across hosts).
WRITTEN = {"written here": (True, True), "confirmed, one host": (False, True), "confirmed, across hosts": (False, False)}


@pytest.mark.parametrize("how", list(WRITTEN))
def test_a_block_is_hashed_once_every_tensor_in_it_is_written(how, ckpt, tmp_path, monkeypatch):
    """In process, with 1000-byte blocks, over a finished one-file merge: once the first half of the batches
    are known written, exactly the blocks whose every tensor (by the file's own header) they wrote have a
    checksum, hashlib's; the rest get theirs when the last batch is."""
    from merger.engine.dist import Group
    from merger.api.pipeline import prepare
    from merger.options import MergeOptions
    from merger.output import resume
    from merger.output.files import FileSink

    own, one_host = WRITTEN[how]
    out, block = tmp_path / "out", 1000
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), "--max_inflight", "1"]) == 0
    options = MergeOptions(local_dir=ckpt, max_inflight=1)
    prepared = prepare(options, Group())
    plan, file = prepared.plan, out / "model.safetensors"
    assert [f.name for f in plan.files] == [file.name] and len(plan.batches) > 4
    monkeypatch.setattr(resume, "CHECKSUM_BLOCK", block)
    manifest = resume.start_manifest(prepared.catalog, {}, options, plan, 1)
    tracker = resume.FileTracker(plan, FileSink(out, plan), Group(), out, manifest, one_host)
    half = len(plan.batches) // 2
    if own:
        for batch in plan.batches[:half]:
            for step in batch.steps:
                tracker.step_written(step)
    else:
        tracker.confirmed(half)
    tracker.wait()

    spans, size = _tensor_spans(file), file.stat().st_size
    done = {o.name for batch in plan.batches[:half] for step in batch.steps for o in plan.steps[step].outputs}
    want = block_sha256(file, block)
    inside = [{name for name, (a, b) in spans.items() if a < min(start + block, size) and b > start and b > a}
              for start in range(0, size, block)]
    # Across hosts other ranks' bytes count only once the file's last batch is confirmed: just the header's.
    ready = [names <= done if one_host else not names for names in inside]
    assert any(ready) and not all(ready) and len(want) > 20
    assert manifest["output_files"][file.name]["sha256_blocks"] == [w if r else None for w, r in zip(want, ready)]

    tracker = resume.FileTracker(plan, FileSink(out, plan), Group(), out, manifest, one_host)
    tracker.confirmed(len(plan.batches))
    tracker.wait()
    assert manifest["output_files"][file.name]["sha256_blocks"] == want


def test_resume_verifies_blocks_on_every_rank(ckpt, tmp_path, monkeypatch):
    """A finished merge with 4000-byte blocks, one bit flipped in its second block of one file and another
    file's last checksum missing: the finished model is no longer intact, and the 3 ranks' shares of the blocks
    together clear every file but those two for reuse."""
    from merger.output import resume

    out, block = tmp_path / "out", 4000
    monkeypatch.setattr(resume, "CHECKSUM_BLOCK", block)
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), *SMALL]) == 0
    manifest = json.loads((out / "merge_manifest.json").read_text())
    files = manifest["output_files"]
    assert {n: f["sha256_blocks"] for n, f in files.items()} == {n: block_sha256(out / n, block) for n in files}
    flipped, unfinished = [n for n in files if len(files[n]["sha256_blocks"]) > 2][:2]
    assert resume.why_not_done(out, manifest) is None  # --resume on the finished model: nothing to do
    data = bytearray((out / flipped).read_bytes())
    data[block + block // 2] ^= 1
    (out / flipped).write_bytes(data)
    assert resume.why_not_done(out, manifest) == f"{flipped} no longer matches its checksums"
    cut = dict(files[unfinished], sha256_blocks=files[unfinished]["sha256_blocks"][:-1] + [None])
    (out / "merge_manifest.json").write_text(json.dumps(dict(manifest, output_files={**files, unfinished: cut})))

    candidates = resume.resume_candidates(out, manifest)
    assert set(candidates) == set(files) - {unfinished}
    shares = [resume.verify_share(out, manifest, candidates, rank, 3) for rank in range(3)]
    assert all(shares)
    assert sorted(resume.intact_files(candidates, shares)) == sorted(set(files) - {flipped, unfinished})


def _paused(procs: list[subprocess.Popen], pause: Path, ranks: int) -> None:
    """Wait until every rank has paused after its batch (paused_merger.py wrote its pid)."""
    deadline = time.monotonic() + 120
    while not all(Path(f"{pause}.{r}").exists() and Path(f"{pause}.{r}").read_text() for r in range(ranks)):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.communicate() for p in procs]
        time.sleep(0.2)


def _kept_and_resumed(ckpt: Path, reference: Path, out: Path, stage: Path, err: str) -> None:
    """A merge stopped by Ctrl-C kept its staging folder and said how to go on; a rerun without --resume or
    --overwrite leaves it alone, and --resume finishes the model."""
    assert stage.is_dir() and (stage / "merge_manifest.json").is_file() and not out.exists()
    kept = (f"; the partial merge is kept in {stage}: rerun with --resume to continue it, or --overwrite to start "
            f"over")
    assert any(line.startswith("merger: error:") and line.endswith(kept) for line in err.splitlines()), err
    before = snapshot(stage)
    again = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, check=False)
    assert again.returncode == 1 and single_error_line(again.stderr) == (
        f"merger: error: a partial merge is kept in {stage}: pass --resume to continue it, or --overwrite to "
        f"start over, {out}")
    assert snapshot(stage) == before and not out.exists()
    resumed = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, "--resume")
    assert "reusing" in resumed.stderr
    assert_same_weights(out, reference, torch.bfloat16)


def test_ctrl_c_keeps_the_partial_merge_and_says_so(ckpt, reference, tmp_path):
    pause = tmp_path / "paused"
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)}
    proc = start_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, env=env)
    _paused([proc], pause, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert [line for line in err.splitlines() if line.startswith("merger: error:")] == [
        f"merger: error: interrupted by SIGINT; the partial merge is kept in {stage}: rerun with --resume to "
        f"continue it, or --overwrite to start over"], err
    _kept_and_resumed(ckpt, reference, out, stage, err)


def test_ctrl_c_at_launcher_local_reaches_every_rank_as_sigint(ckpt, reference, tmp_path):
    # The terminal's Ctrl-C goes to the launcher (its ranks run in sessions of their own): each rank must learn
    # it as SIGINT, once, and not be terminated in the middle of its cleanup.
    pause = tmp_path / "paused"
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)}
    launcher = subprocess.Popen([sys.executable, ROOT / "tests" / "paused_launcher.py", "local", "--nproc",
                                 str(WORLD), "--", "merge", "--local_dir", ckpt, "--target_dir", out, *SMALL],
                                cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _paused([launcher], pause, WORLD)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    errors = sorted(line for line in err.splitlines() if line.startswith("merger: error:"))
    assert launcher.returncode == 130 and "SIGTERM" not in err, err
    assert errors == [f"merger: error: interrupted by SIGINT (rank 0); the partial merge is kept in {stage}: rerun "
                      f"with --resume to continue it, or --overwrite to start over",
                      "merger: error: interrupted by SIGINT (rank 1)"], err
    _kept_and_resumed(ckpt, reference, out, stage, err)


# Options that change how a merge runs, not what it writes: a resume with them reuses the finished files all the same.
RUNTIME_FLAGS = {"no flags": [], "verify, summary, explicit backend": ["--verify", "--summary_json", "SUMMARY",
                                                                       "--backend", "fsdp", "--dist_timeout", "300"]}


@pytest.mark.parametrize("flags", list(RUNTIME_FLAGS))
def test_resume_after_a_killed_rank_reuses_finished_files(flags, ckpt, reference, tmp_path):
    out = tmp_path / "out"
    extra = [str(tmp_path / "summary.json") if f == "SUMMARY" else f for f in RUNTIME_FLAGS[flags]]
    stage = tmp_path / ".out.merger-partial"
    proc = _kill_rank_mid_merge(ckpt, out, tmp_path, "--keep-partial")[0]
    assert proc.returncode != 0 and not out.exists() and stage.is_dir(), proc.stderr
    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished = {n for n, f in manifest["output_files"].items() if all(f["sha256_blocks"])}
    assert finished and finished != set(manifest["output_files"]), manifest  # some files done, not all
    before = {n: (os.stat(stage / n).st_ino, os.stat(stage / n).st_mtime_ns) for n in finished}

    # Resumed by 3 ranks, not 2: they verify the finished files between them, and the bytes do not depend on M.
    resumed = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, "--resume", *extra, nproc=3)
    assert f"reusing {len(finished)} of {len(manifest['output_files'])} output files" in resumed.stderr
    assert_same_weights(out, reference, torch.bfloat16)
    assert {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in finished} == before
    final = json.loads((out / "merge_manifest.json").read_text())
    assert final["complete"] is True
    for name, info in final["output_files"].items():
        assert info["sha256_blocks"] == block_sha256(out / name, final["checksum_block_bytes"])


def _newer(ckpt: Path, other: Path) -> Path:
    """Retrained: the file's mtime moves on."""
    st = os.stat(ckpt / RANK0)
    os.utime(ckpt / RANK0, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return ckpt


def _rewritten_mtime_kept(ckpt: Path, other: Path) -> Path:
    """Other contents of the same size written over the file, its mtime set back: only the ctime tells."""
    st = os.stat(ckpt / RANK0)
    (ckpt / RANK0).write_bytes((other / RANK0).read_bytes())
    os.utime(ckpt / RANK0, ns=(st.st_atime_ns, st.st_mtime_ns))
    return ckpt


def _copy_elsewhere_mtimes_kept(ckpt: Path, other: Path) -> Path:
    """Another checkpoint with the same file names, sizes and mtimes, in another folder."""
    copy = Path(shutil.copytree(other, ckpt.parent / "other_actor"))
    for f in copy.iterdir():
        if f.is_file():
            st = os.stat(ckpt / f.name)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copy


CHANGES = {"newer mtime": _newer, "rewritten, mtime kept": _rewritten_mtime_kept,
           "copy elsewhere, mtimes kept": _copy_elsewhere_mtimes_kept}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_source_invalidates_resume(change, ckpt, fsdp_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="merger")
    other, other_reference = fsdp_checkpoint("llama", WORLD, extra=("--seed", "1"))  # same shapes, other values
    assert (other / RANK0).stat().st_size == (ckpt / RANK0).stat().st_size
    out = tmp_path / "out"
    stage = tmp_path / ".out.merger-partial"
    _kill_rank_mid_merge(ckpt, out, tmp_path, nproc=1, victim=0)  # SIGKILL leaves the staging folder behind
    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished = {n for n, f in manifest["output_files"].items() if all(f["sha256_blocks"])}
    assert finished
    before = {n: (os.stat(stage / n).st_ino, os.stat(stage / n).st_mtime_ns) for n in finished}
    source = CHANGES[change](ckpt, other)

    assert main(["merge", "--local_dir", str(source), "--target_dir", str(out), *SMALL, "--resume"]) == 0
    assert "source files changed" in caplog.text or "source folder changed" in caplog.text
    after = {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in finished}
    assert all(after[n] != before[n] for n in finished)  # every file written again
    if source != ckpt:
        assert_same_weights(out, other_reference, torch.bfloat16)  # the other checkpoint's model, not a mix


def test_resume_counts_only_the_bytes_still_to_write_against_free_space(ckpt, tmp_path):
    """After a disk-full failure the kept staging folder's unfinished files fill the disk; --resume writes them
    anew, so their space counts as free (it used to refuse the resume that would fit)."""
    from merger.engine.dist import Group
    from merger.api.pipeline import prepare
    from merger.options import MergeOptions
    from merger.output.files import prepare_files

    plan = prepare(MergeOptions(local_dir=ckpt, max_shard_size=20_000), Group()).plan
    assert len(plan.files) > 2
    total = sum(f.size for f in plan.files)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size = sum(-(-f.size // 4096) * 4096 for f in plan.files) + 2 * 4096  # every file, two pages to spare
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        stage = mnt / ".model.merger-partial"
        stage.mkdir()
        for f in plan.files:  # every file written to its full size, none finished but the first
            (stage / f.name).write_bytes(os.urandom(f.size))
        st = os.statvfs(mnt)
        assert st.f_bavail * st.f_frsize < total - plan.files[0].size  # the old check would refuse
        keep = plan.files[0].name
        kept = (stage / keep).read_bytes()
        prepare_files(stage, plan, keep=frozenset({keep}))
        assert (stage / keep).read_bytes() == kept
        assert all((stage / f.name).stat().st_size == f.size for f in plan.files)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_flipped_bit_in_a_rank_file_fails_its_checksum(ckpt, tmp_path):
    """A bit flipped inside a tensor's bytes is caught by the CRC-32 the rank file's zip records."""
    import torch.distributed.tensor  # noqa: F401  DTensor for the weights_only load

    name = "model.embed_tokens.weight"
    local = torch.load(ckpt / RANK1, weights_only=True)[name]._local_tensor
    flip_bit_in_tensor(ckpt / RANK1, local)
    out = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, check=False)
    assert proc.returncode == 1
    error = single_error_line(proc.stderr)
    assert f"checksum mismatch in tensor {name}" in error and error.endswith(str(ckpt / RANK1)), error
    assert not out.exists() and not (tmp_path / ".out.merger-partial").exists()


def test_source_truncated_during_the_merge_is_an_error_not_sigbus(ckpt, tmp_path):
    """A rank file cut short while the merge streams (paused with SIGSTOP once its first output bytes are on
    disk) gives one error line naming the file; the staging folder is removed. Reading through a mapping would
    die of SIGBUS (returncode -7) here."""
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    proc = start_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL)
    deadline = time.monotonic() + 120
    while not (stage.is_dir() and any(p.suffix == ".safetensors" and p.stat().st_size for p in stage.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for rank_file in (RANK0, RANK1):
            os.truncate(ckpt / rank_file, (ckpt / rank_file).stat().st_size // 2)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, (proc.returncode, stderr)
    error = single_error_line(stderr)
    # Cut short while it is read, or (if the reads were done when the test stopped the merge) caught by the
    # identity check before the final rename: either way one line, never SIGBUS.
    assert "source file shrank while being read" in error or "source file changed while" in error, error
    assert error.endswith((str(ckpt / RANK0), str(ckpt / RANK1))), error
    assert not out.exists() and not stage.exists()
