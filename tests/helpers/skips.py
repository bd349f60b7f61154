"""Skips for causes outside the project's control."""
import importlib.metadata

import pytest


def need_torchtitan():
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        pytest.skip("torchtitan 0.3.0 imports triton at import time and triton is not installed (pip install triton)")


def need_fla():
    """torchtitan's qwen3_5 imports FLA (fla-core) at import time. Asked of the installed distributions, not of
    `import fla`, which the test process refuses (tests/conftest.py)."""
    try:
        importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtitan's qwen3_5 needs fla-core (flash-linear-attention) and it is not installed "
                    "(pip install fla-core)")
