"""The writer venv of the test writers that need Python >= 3.12 (megatron-core 0.19: tests/writers/megatron_dsa.py):
.venv-writers312, which `make writers312` (and so `make test`) builds from tests/writers/requirements312.txt, then
tests/writers/requirements312-nodeps.txt without dependencies (Megatron-Bridge: tests/writers/megatron_qwen3_vl.py)."""
from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.python_of_version import python_of_version

WRITERS312 = ROOT / ".venv-writers312"


def writers312_python() -> str:
    """The writer venv's python. Skips where the machine has no Python 3.12 to build it from (make found none by the
    same rule, tests/helpers/python_of_version.py, and said so); where it has one, a venv not built is a failure."""
    if (WRITERS312 / ".installed").exists():
        return str(WRITERS312 / "bin" / "python")
    if python_of_version("3.12") is None:
        pytest.skip("megatron-core 0.19 (DeepSeek Sparse Attention) needs Python >= 3.12 and this machine has none "
                    "(pyenv's 3.12.x or python3.12 on PATH)")
    raise AssertionError(f"{WRITERS312} is not built: run `make writers312`")
