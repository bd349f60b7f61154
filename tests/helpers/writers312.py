"""The writer venv of the test writers that need Python >= 3.12 (megatron-core 0.19: tests/writers/megatron_dsa.py):
.venv-writers312, which `make writers312` (and so `make test`) builds from tests/writers/requirements312.txt."""
from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

WRITERS312 = ROOT / ".venv-writers312"


def python312_on_machine() -> str | None:
    """A Python 3.12 as the Makefile finds one: pyenv's 3.12.x, else python3.12 on PATH."""
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    for python in [*sorted(glob.glob(f"{pyenv_root}/versions/3.12*/bin/python")), "python3.12"]:
        try:
            check = subprocess.run([python, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                   capture_output=True)
        except OSError:
            continue
        if check.returncode == 0:
            return python
    return None


def writers312_python() -> str:
    """The writer venv's python. Skips where the machine has no Python 3.12 to build it from; where it has one, a
    venv not built is a failure."""
    if (WRITERS312 / ".installed").exists():
        return str(WRITERS312 / "bin" / "python")
    if python312_on_machine() is None:
        pytest.skip("megatron-core 0.19 (DeepSeek Sparse Attention) needs Python >= 3.12 and this machine has none "
                    "(pyenv's 3.12.x or python3.12 on PATH)")
    raise AssertionError(f"{WRITERS312} is not built: run `make writers312`")
