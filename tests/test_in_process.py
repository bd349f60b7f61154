"""merger called from Python (as the tests and a training script may) leaves the interpreter as it found it."""
from __future__ import annotations

import sys

import pytest

from tests.helpers.processes import run
from tests.helpers.weights import assert_same_weights

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

MERGE_IN_PROCESS = """
import gc, sys
import torch._dynamo  # imports triton when it is installed, as `import peft` does in the test process
from merger.cli import main
assert main(["merge", "--local_dir", sys.argv[1], "--target_dir", sys.argv[2], "--dtype", "keep"]) == 0
assert gc.get_freeze_count() == 0, gc.get_freeze_count()
"""


def test_merge_in_process_unfreezes_the_garbage_collector(fsdp_checkpoint, tmp_path):
    """The stream freezes the long-lived objects for its duration only: after it, gc can collect them again (else
    triton's nanobind objects outlive the interpreter and it prints ~30 'nanobind: leaked' lines at exit)."""
    actor, reference = fsdp_checkpoint("llama", world=1)
    proc = run([sys.executable, "-c", MERGE_IN_PROCESS, actor, tmp_path / "out"])
    assert "nanobind" not in proc.stderr, proc.stderr[-2000:]
    assert_same_weights(tmp_path / "out", reference, None)
