"""Skips for causes outside the project's control."""
import pytest


def need_torchtitan():
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        pytest.skip("torchtitan 0.3.0 imports triton at import time and triton is not installed (pip install triton)")
