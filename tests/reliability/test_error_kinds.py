"""Errors with a kind (docs/api.md, "Errors and exit codes"): each real failure is its kind's class through the API
and its kind's exit code through the CLI. The oracle for the codes is sysexits.h, as Python's os module spells it
(os.EX_NOINPUT...), which the docs promise; each failure is a real one: a folder that is not there, a file cut
short, a folder that is not empty. A busy target (a live merge's lock) and refused credentials (moto's server
checking keys) are asserted where those set-ups live already: test_source_and_target and test_object_storage."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import merger
from tests.helpers.in_process import command_here, merge_here
from tests.helpers.processes import start_ranks
from tests.helpers.reliability import RANK1

pytestmark = pytest.mark.slow


def _truncated(ckpt: Path) -> Path:
    os.truncate(ckpt / RANK1, (ckpt / RANK1).stat().st_size // 2)
    return ckpt


def _not_empty(tmp_path: Path) -> Path:
    folder = tmp_path / "user_folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("user data")
    return folder


# kind: (damage to the source, the target, extra options as the API's keywords, the class, the exit code)
KINDS = {
    "source": (lambda ckpt: ckpt.parent / "no_such_actor", lambda tmp: tmp / "out", {}, merger.SourceError,
               os.EX_NOINPUT),
    "corrupt": (_truncated, lambda tmp: tmp / "out", {}, merger.CorruptSourceError, os.EX_DATAERR),
    "target": (lambda ckpt: ckpt, _not_empty, {}, merger.TargetError, os.EX_CANTCREAT),
    "usage": (lambda ckpt: ckpt, lambda tmp: tmp / "out", {"dtype": "bf17"}, merger.UsageError, 2),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_failure_is_its_kinds_class_in_the_api_and_its_code_in_the_cli(kind, ckpt, tmp_path, capsys):
    damage, target_of, options, cls, code = KINDS[kind]
    source, target = damage(ckpt), target_of(tmp_path)
    with pytest.raises(merger.MergerError) as raised:
        merger.merge(local_dir=source, target_dir=target, **options)
    assert type(raised.value) is cls and raised.value.kind == kind, raised.value
    flags = [arg for key, value in options.items() for arg in (f"--{key}", value)]
    said, errors = merge_here(capsys, "--local_dir", source, "--target_dir", target, *flags)
    assert said == code and errors == [f"merger: error: {raised.value}"], errors


def test_input_merger_cannot_use_is_the_plain_kind_other(ckpt, tmp_path, capsys):
    """A rank file count that contradicts fsdp_config.json: no kind a caller could act on, so MergerError itself."""
    (ckpt / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}')
    with pytest.raises(merger.MergerError) as raised:
        merger.merge(local_dir=ckpt, target_dir=tmp_path / "out")
    assert type(raised.value) is merger.MergerError and raised.value.kind == "other"
    assert merge_here(capsys, "--local_dir", ckpt, "--target_dir", tmp_path / "out")[0] == 1


def test_the_kind_of_one_ranks_failure_reaches_every_rank(ckpt, tmp_path):
    """Only merge rank 1 opens rank file 1: cut short, it fails there, and rank 0 learns it at the sync point. Both
    ranks (plain env:// processes, whose exit codes are their own) exit with the corrupt kind's code; rank 0 alone
    prints the line, naming rank 1."""
    _truncated(ckpt)
    ranks = start_ranks("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", nproc=2)
    said = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [os.EX_DATAERR] * 2, said
    lines = [[line for line in err.splitlines() if line.startswith("merger: error:")] for _, err in said]
    assert len(lines[0]) == 1 and lines[0][0].startswith("merger: error: rank 1: truncated: "), said
    assert lines[0][0].endswith(str(ckpt / RANK1)) and lines[1] == [], said
    assert not (tmp_path / "out").exists()


def test_watch_once_exits_with_the_kind_its_failed_steps_share(ckpt, tmp_path, capsys):
    """Two finished steps, each with a rank file cut short: `watch --once` converts neither and exits 65."""
    run = tmp_path / "run"
    for step in (1, 2):
        _truncated(Path(shutil.copytree(ckpt, run / f"global_step_{step}" / "actor")))
    (run / "latest_checkpointed_iteration.txt").write_text("2\n")
    code, errors = command_here(capsys, "watch", "--local_dir", run, "--target_dir", tmp_path / "hf", "--once")
    assert code == os.EX_DATAERR, errors
    assert errors == [f"merger: error: 2 finished steps could not be converted (global_step_1, global_step_2; each "
                      f"one's error is above), {run}"]

