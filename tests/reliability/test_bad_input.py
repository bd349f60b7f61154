"""Bad input: damaged, missing or hostile source files and targets that cannot be written fail before any
output, with one line naming the file; code-running pickles and links out of the folder are refused, the Hub
token is never printed, and rank files damaged while they are read are errors, not crashes.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder (tests/reliability/conftest.py's `ckpt`) and damaged there as the case
needs. The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and
the processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from merger.cli import main
from tests.helpers.files import flip_bit_in_tensor, snapshot
from tests.helpers.in_process import command_here, merge_here, single_error_line
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_merger, start_merger, subprocess_env
from tests.helpers.reliability import RANK0, RANK1, SMALL
from tests.helpers.weights import assert_same_weights

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]


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


# The exit code is the error's kind (docs/api.md): sysexits.h's EX_NOINPUT for a source that is not there to read,
# EX_DATAERR for a damaged one, 1 for input merger cannot use.
BAD_INPUT = {
    "missing rank file": (_delete_rank1, "missing", RANK1, os.EX_NOINPUT),
    "truncated rank 0": (_truncate(RANK0), "truncated: the file's", RANK0, os.EX_DATAERR),
    "truncated rank 1": (_truncate(RANK1), "truncated: the file's", RANK1, os.EX_DATAERR),
    "random bytes": (_random_bytes, "cannot load rank file: not a torch.save file", RANK1, os.EX_DATAERR),
    "world size contradicted": (_world_size_lie, "world_size 4", "fsdp_config.json", 1),
    "shards disagree across ranks": (_rank0_as_rank1, "local shape", RANK1, 1),
    "unknown layout": (_no_rank_files, "no known checkpoint layout", "actor", os.EX_NOINPUT),
    "missing config": (_no_config, "no config.json", "huggingface", os.EX_NOINPUT),
    "missing HF folder": (_no_hf_dir, "no HF config folder", "actor", os.EX_NOINPUT),
    "unreadable rank file": (_rank1_unreadable, "cannot load rank file", RANK1, os.EX_DATAERR),
    "config.json links out of the folder": (_config_links_out, "no config.json", "huggingface", os.EX_NOINPUT),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_before_any_output(case, ckpt, tmp_path, capsys):
    damage, what, file, exit_code = BAD_INPUT[case]
    damage(ckpt)
    source = snapshot(ckpt)
    out = tmp_path / "out"
    code, errors = merge_here(capsys, "--local_dir", ckpt, "--target_dir", out / "model")
    assert code == exit_code, errors
    assert len(errors) == 1 and what in errors[0] and file in errors[0].rsplit(", ", 1)[1], errors
    assert not out.exists()  # not even the target's parent: every check ran before anything was created
    assert snapshot(ckpt) == source


def test_truncated_rank_file_fails_plain_inspect_and_merge(ckpt, tmp_path, capsys):
    """Rank 1's file cut short by a byte (its zip directory, at its end, gone): plain inspect, which loads only
    rank 0's file to describe the checkpoint, names it as a merge does before it starts, from the zip's end alone."""
    os.truncate(ckpt / RANK1, (ckpt / RANK1).stat().st_size - 1)
    size = (ckpt / RANK1).stat().st_size
    line = f"merger: error: truncated: the file's {size} bytes end without the zip directory"
    out = tmp_path / "out"
    for command in (["inspect", "--local_dir", ckpt], ["merge", "--local_dir", ckpt, "--target_dir", out / "model"]):
        code, errors = command_here(capsys, *command)
        assert code == os.EX_DATAERR and len(errors) == 1, errors
        assert errors[0].startswith(line) and errors[0].endswith(f", {ckpt / RANK1}"), errors
    assert not out.exists()


def test_source_that_is_not_a_folder(ckpt, tmp_path, capsys):
    code, errors = merge_here(capsys, "--local_dir", ckpt / RANK0, "--target_dir", tmp_path / "out")
    assert code == os.EX_NOINPUT and errors == [f"merger: error: checkpoint path is not a folder, {ckpt / RANK0}; pass "
                                                f"the folder that holds it: --local_dir {ckpt}"]


@pytest.mark.parametrize("unreadable", [".", "huggingface"])
def test_unreadable_folder_is_named(unreadable, ckpt):
    """A checkpoint folder (or one of its folders) that this user cannot list is named, not a path below it that
    merger probed (`model/.hf_metadata`, which need not exist). Root reads any folder, so merger runs as nobody
    (setpriv) on a copy in a folder that nobody can reach."""
    drop = [] if os.geteuid() != 0 else ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if drop and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: nothing to run merger as a user that permissions bind")
    reachable = Path(tempfile.mkdtemp(prefix="unreadable-"))
    try:
        reachable.chmod(0o777)
        source = Path(shutil.copytree(ckpt, reachable / "actor"))
        denied = (source / unreadable).resolve()
        denied.chmod(0)
        out = reachable / "out" / "model"
        proc = subprocess.run([*drop, sys.executable, "-m", "merger", "merge", "--local_dir", source, "--target_dir", out],
                              cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == os.EX_NOINPUT, proc.stderr
        line = single_error_line(proc.stderr)
        named = Path(line.rsplit(", ", 1)[1])
        assert line.startswith("merger: error: permission denied: cannot list the folder, "), line
        assert named == denied and named.is_dir() and stat.S_IMODE(named.stat().st_mode) == 0, line
        assert not out.parent.exists()
    finally:
        for folder in reachable.rglob("*"):
            if folder.is_dir():
                folder.chmod(0o755)
        shutil.rmtree(reachable)


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
    assert code == os.EX_CANTCREAT and len(errors) == 1 and errors[0].endswith(f", {named}"), errors
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
        assert code == os.EX_DATAERR and len(errors) == 1, errors
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
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "out2"), "--debug"]) == os.EX_DATAERR
    captured = capsys.readouterr()
    assert "merger: error:" in captured.err and token not in captured.out + captured.err + caplog.text


def test_flipped_bit_in_a_rank_file_fails_its_checksum(ckpt, tmp_path):
    """A bit flipped inside a tensor's bytes is caught by the CRC-32 the rank file's zip records."""
    import torch.distributed.tensor  # noqa: F401  DTensor for the weights_only load

    name = "model.embed_tokens.weight"
    local = torch.load(ckpt / RANK1, weights_only=True)[name]._local_tensor
    flip_bit_in_tensor(ckpt / RANK1, local)
    out = tmp_path / "out"
    proc = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, check=False)
    assert proc.returncode == os.EX_DATAERR
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
