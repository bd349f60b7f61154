"""Ranks that see different checkpoints stop before anything is written: two real merge ranks, each given its own
--local_dir (as two nodes mounting different copies would see them), one a verl FSDP checkpoint saved by 2 ranks,
the other the same model saved by 4."""
from __future__ import annotations

import pytest

from tests.helpers.in_process import single_error_line
from tests.helpers.processes import start_ranks

pytestmark = pytest.mark.slow


def test_ranks_shown_different_checkpoints_stop_before_writing(fsdp_checkpoint, tmp_path):
    two, _ = fsdp_checkpoint("llama", 2)
    four, _ = fsdp_checkpoint("llama", 4)
    out = tmp_path / "out"
    args = ["merge", "--local_dir", two, "--target_dir", out]
    procs = start_ranks(*args, nproc=2, args_of_rank={1: ["merge", "--local_dir", four, "--target_dir", out]})
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert single_error_line("".join(err for _, err in outputs)) == (
        f"merger: error: the ranks see different checkpoints: rank 1 sees 4 source files, rank 0 sees 2: "
        f"model_world_size_2_rank_0.pt only on rank 0; every rank must see the same files (one shared folder, or "
        f"identical copies), {two}")
    assert list(tmp_path.iterdir()) == []  # no target, no staging folder, no lock
