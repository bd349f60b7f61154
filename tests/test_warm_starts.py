"""merger forked warm (tests/helpers/warm_merger.py) answers as merger started cold by its interpreter does: the
same exit status, stdout and stderr, and the same output files, on one process and on the ranks of a group. The
cold start is the oracle; a difference would make every test that starts merger warm test something else."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import warm_merger
from tests.helpers.processes import run_merger

pytestmark = pytest.mark.slow


def _run(monkeypatch, start: str, *args, **kwargs):
    """run_merger(ARGS) started `cold` or `warm`, checking that it was."""
    monkeypatch.setattr(warm_merger, "allowed", start == "warm")
    before = warm_merger.started()
    outcome = run_merger(*args, check=False, **kwargs)
    assert warm_merger.started() - before == (kwargs.get("nproc", 1) if start == "warm" else 0)
    return outcome


@pytest.mark.parametrize("args", [["--version"], ["merge", "--help"], ["merge", "--bogus"],
                                  ["merge", "--local_dir", "no/such/folder", "--target_dir", "out"]],
                         ids=["version", "help", "usage error", "missing source"])
def test_answers_are_a_cold_starts(monkeypatch, tmp_path, args):
    cold, warm = (_run(monkeypatch, start, *args, cwd=tmp_path) for start in ("cold", "warm"))
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_merge_writes_what_a_cold_start_writes(monkeypatch, tmp_path, fsdp_checkpoint, nproc):
    """A relative --target_dir lands in the folder the run was started in, with the same bytes."""
    actor, _ = fsdp_checkpoint("llama", 2)
    runs = {}
    for start in ("cold", "warm"):
        (tmp_path / start).mkdir()
        runs[start] = _run(monkeypatch, start, "merge", "--local_dir", actor, "--target_dir", "model", "--dtype",
                           "bfloat16", nproc=nproc, cwd=tmp_path / start)
    assert runs["warm"].returncode == runs["cold"].returncode == 0
    assert _files(tmp_path / "warm" / "model") == _files(tmp_path / "cold" / "model") != {}


def test_a_variable_this_process_gains_later_reaches_a_warm_start(monkeypatch, tmp_path):
    """A library a test imports may set variables in the test process's environment (compressed_tensors' import sets
    TORCHINDUCTOR_CACHE_DIR) after its forker started: the starts that follow are still warm, and still answer as
    cold ones do."""
    _run(monkeypatch, "warm", "--version", cwd=tmp_path)
    monkeypatch.setenv("A_LIBRARYS_CACHE_DIR", str(tmp_path))
    cold, warm = (_run(monkeypatch, start, "merge", "--bogus", cwd=tmp_path) for start in ("cold", "warm"))
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
