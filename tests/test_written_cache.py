"""The cache of written checkpoints (tests/helpers/written_cache.py): a second identical invocation gets a copy of
what the first wrote without running the writer, anything that changes the key runs it again, and a write that
fails leaves no entry. The writer here is a function writing files; the real writers go through it the same way."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import written_cache
from tests.helpers.files import snapshot

pytestmark = pytest.mark.interpreter


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(written_cache, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(written_cache, "WRITER_TIMES", tmp_path / "times")  # not the run's own writers' figures
    monkeypatch.delenv("MERGER_TEST_CACHE", raising=False)
    return tmp_path / "cache"


def _write(tmp_path, name: str, *args, per_interpreter: bool = False, fail: bool = False) -> list[str]:
    """Write a two-folder checkpoint for ARGS into fresh folders of tmp_path / NAME through the cache; the calls
    the writer got."""
    calls = []
    out, oracle = tmp_path / name / "out", tmp_path / name / "oracle"
    out.mkdir(parents=True)
    oracle.mkdir()

    def writer():
        calls.append(name)
        (out / "ckpt" / "rank0").mkdir(parents=True)
        (out / "ckpt" / "rank0" / "weights.bin").write_bytes(" ".join(map(str, args)).encode())
        if fail:
            raise AssertionError("the writer failed")
        (oracle / "logits.pt").write_bytes(b"logits")

    written_cache.write_through_cache("w.py", ["--out", out / "ckpt", "--logits", oracle / "logits.pt", *args], 1,
                                      None, sys.executable, per_interpreter, writer)
    return calls


def test_second_invocation_copies_what_the_first_wrote(cache, tmp_path):
    assert _write(tmp_path, "a", "--seed", "1") == ["a"]
    assert _write(tmp_path, "b", "--seed", "1") == []
    assert snapshot(tmp_path / "b" / "out") == snapshot(tmp_path / "a" / "out") != {}
    assert (tmp_path / "b" / "oracle" / "logits.pt").read_bytes() == b"logits"
    (tmp_path / "b" / "out" / "ckpt" / "rank0" / "weights.bin").write_bytes(b"damaged")  # a test's own copy
    assert _write(tmp_path, "c", "--seed", "1") == []
    assert snapshot(tmp_path / "c" / "out") == snapshot(tmp_path / "a" / "out")


def test_another_argument_or_interpreter_key_writes_again(cache, tmp_path):
    assert _write(tmp_path, "a", "--seed", "1") == ["a"]
    assert _write(tmp_path, "b", "--seed", "2") == ["b"]
    assert _write(tmp_path, "c", "--seed", "1", per_interpreter=True) == ["c"]
    assert (tmp_path / "b" / "out" / "ckpt" / "rank0" / "weights.bin").read_bytes() == b"--seed 2"


def test_failed_write_leaves_no_entry(cache, tmp_path):
    with pytest.raises(AssertionError, match="the writer failed"):
        _write(tmp_path, "a", fail=True)
    assert not cache.exists() or not any(cache.iterdir())
    assert _write(tmp_path, "b") == ["b"]


def test_disabled_cache_always_writes(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGER_TEST_CACHE", "0")
    assert _write(tmp_path, "a") == ["a"]
    assert _write(tmp_path, "b") == ["b"]
    assert not cache.exists()


def test_output_folder_with_files_in_it_is_not_cached(cache, tmp_path):
    (tmp_path / "a" / "out").mkdir(parents=True)
    (tmp_path / "a" / "out" / "input.json").write_text("{}")  # an input the key would not see
    calls = []
    written_cache.write_through_cache("w.py", ["--in", tmp_path / "a" / "out"], 1, None, sys.executable, False,
                                      lambda: calls.append(1))
    assert calls == [1] and not cache.exists()
