"""Usual mistakes get a hint in the one-line error, as real merger processes on a real verl FSDP checkpoint:
--local_dir one level too high, and LoRA flags on a checkpoint with no adapter."""
from __future__ import annotations

import re

import pytest

from conftest import assert_same_weights, run_merger
from merger.sources import BACKENDS


def test_local_dir_one_level_too_high_names_the_checkpoint_below(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=1)
    step = actor.parent  # global_step_1/, which holds actor/
    proc = run_merger("merge", "--local_dir", step, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"merger: error: no known checkpoint layout (looked for: {', '.join(BACKENDS)}), "
                           f"{step}; actor/ below it looks like a checkpoint (--backend fsdp): pass --local_dir ")
    assert not (tmp_path / "out").exists()
    # following the hint merges the model
    suggested = re.search(r"actor/ below it .*?: pass --local_dir (\S+)", line).group(1)
    run_merger("merge", "--local_dir", suggested, "--target_dir", tmp_path / "out", "--dtype", "keep")
    assert_same_weights(tmp_path / "out", reference, None)


@pytest.mark.parametrize("flags, named", [(["--lora", "separate"], "--lora separate"),
                                          (["--lora_alpha", "16"], "--lora_alpha")])
def test_lora_flags_on_a_checkpoint_without_lora_are_an_error(fsdp_checkpoint, tmp_path, flags, named):
    actor, _ = fsdp_checkpoint("llama", world=1)
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", *flags, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"merger: error: {named} applies to checkpoints with a LoRA adapter, and this fsdp checkpoint has none "
        f"(no lora_A / lora_B tensors), {actor}")
    assert not (tmp_path / "out").exists()
