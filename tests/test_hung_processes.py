"""A merger process that runs past its test's timeout fails the test with its own stacks (tests/helpers/hung.py),
whether it was started warm or cold, and is gone afterwards. `merger watch` on a run with no step is a merger that
waits as long as it is let: the stand-in for a hang."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import warm_merger
from tests.helpers.hung import TimedOut
from tests.helpers.processes import run_merger

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_a_merger_past_its_timeout_shows_its_stacks_and_ends(monkeypatch, tmp_path, start):
    monkeypatch.setattr(warm_merger, "allowed", start == "warm")
    (tmp_path / "run").mkdir()
    with pytest.raises(TimedOut) as hung:
        # cold: time for the interpreter to start and import torch, well past what this machine needs
        run_merger("watch", "--local_dir", tmp_path / "run", "--target_dir", tmp_path / "out",
                   timeout=3 if start == "warm" else 15)
    message = str(hung.value)
    assert "Fatal Python error: Aborted" in message, message
    # faulthandler's frames, innermost first: the main thread waits in merger's watch loop
    frames = re.findall(r'File "([^"]+)", line \d+ in (\w+)', message)
    assert any("/merger/" in path and "watch" in path for path, _ in frames), message
    assert not [pid for pid in _running_with(str(tmp_path / "out"))], "the timed-out merger still runs"


def _running_with(argument: str) -> list[str]:
    """The pids of the processes, zombies aside, whose command line holds `argument`."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            running = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if running and argument.encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                pids.append(proc.name)
        except OSError:  # ended meanwhile
            continue
    return pids
