"""The failure-behaviour tests' checkpoint: a real 2-rank FSDP2 checkpoint, and a private copy of it for each
test to damage."""
import shutil
from pathlib import Path

import pytest

from tests.helpers.reliability import WORLD


@pytest.fixture(scope="module")
def pristine(fsdp_checkpoint):
    return fsdp_checkpoint("llama", WORLD)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private copy of the real checkpoint, for the test to damage."""
    return Path(shutil.copytree(pristine[0], tmp_path / "src" / "actor"))


@pytest.fixture
def reference(pristine) -> Path:
    return pristine[1]
