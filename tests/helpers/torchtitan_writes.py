"""Real torchtitan checkpoints for the tests, written by torchtitan itself (tests/writers/torchtitan_checkpoint.py)."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.processes import run_writer
from tests.helpers.skips import need_torchtitan

TOKENS = [[1, 5, 7, 9, 11, 3, 42, 100]]  # the writer's TOKENS, whose logits it saves


def written_by_torchtitan(tmp_path_factory, family: str, *extra: str) -> Path:
    """ROOT/checkpoint/step-1 (the DCP folder torchtitan saved on 2 gloo ranks), ROOT/hf, ROOT/logits.pt."""
    need_torchtitan()
    root = tmp_path_factory.mktemp(f"torchtitan_{family}")
    run_writer("torchtitan_checkpoint.py", "--family", family, *extra, "--out", root / "checkpoint" / "step-1",
               "--hf", root / "hf", "--logits", root / "logits.pt", nproc=2)
    return root
