"""Real torchtitan checkpoints for the tests, written by torchtitan itself (tests/writers/torchtitan_checkpoint.py)."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.skips import need_torchtitan

TOKENS = [[1, 5, 7, 9, 11, 3, 42, 100]]  # the writer's TOKENS, whose logits it saves


def written_by_torchtitan(tmp_path_factory, family: str, *extra: str) -> Path:
    """ROOT/checkpoint/step-1 (the DCP folder torchtitan saved on 2 gloo ranks), ROOT/hf, ROOT/logits.pt."""
    need_torchtitan()
    root = tmp_path_factory.mktemp(f"torchtitan_{family}")
    run_writer("torchtitan_checkpoint.py", "--family", family, *extra, "--out", root / "checkpoint" / "step-1",
               "--hf", root / "hf", "--logits", root / "logits.pt", nproc=2)
    return root


def refused_as_kimi_k25(root: Path, tmp_path: Path) -> str:
    """The one error line of merging ROOT's checkpoint with transformers' kimi_k25 (the VLM) around ROOT/hf's
    text config as config.json (TMP_PATH/hf), which must write nothing."""
    text = json.loads((root / "hf" / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    proc = run_merger("merge", "--local_dir", root / "checkpoint" / "step-1", "--target_dir", tmp_path / "out",
                      "--hf_model_config_path", tmp_path / "hf", check=False)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    return single_error_line(proc.stderr)
