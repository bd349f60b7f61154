"""`python -m launcher`, its ranks started as tests/helpers/paused_merger.py instead of `python -m merger`.

With the environment paused_merger.py reads (MERGER_TEST_PAUSE_AFTER_BATCH, MERGER_TEST_PAUSE_FILE), a test stops
a real `launcher local` merge at a known batch and then signals the launcher. Only the command each rank runs
is changed; the launcher's own code, what it passes on and when, is what runs.
"""
import subprocess
import sys
from pathlib import Path

from launcher.cli import main

PAUSED_MERGER = str(Path(__file__).with_name("paused_merger.py"))
_popen = subprocess.Popen


def _paused_ranks(cmd, *args, **kwargs):
    at = cmd.index("-m")  # [python, -m, merger, ARGS...] -> [python, paused_merger.py, ARGS...]
    return _popen([*cmd[:at], PAUSED_MERGER, *cmd[at + 2:]], *args, **kwargs)


if __name__ == "__main__":
    subprocess.Popen = _paused_ranks
    sys.exit(main())
