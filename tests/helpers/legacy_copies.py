"""Copies of a Megatron-LM legacy save (`--ckpt-format torch`) with their rank files' states edited: the bad
input a test makes from a checkpoint the writers wrote."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


def edited_copy(legacy: Path, dest: Path, edit) -> Path:
    """A copy of a legacy save whose rank files' states went through `edit`."""
    shutil.copytree(legacy, dest)
    for rank_file in dest.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(rank_file, weights_only=False)  # our own test file
        edit(state)
        torch.save(state, rank_file)
    return dest
