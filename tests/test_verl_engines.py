"""verl's torchtitan and automodel engines, merged from the folders verl names (`global_step_N/actor`).

- torchtitan: torchtitan's own CheckpointManager saves a trained, FSDP-sharded Qwen3 (2 gloo ranks) with its
  optimizer, LR scheduler and train state, its folder set as verl's engine sets it: `step-N/` lands beside
  `actor/` (tests/writers/verl_torchtitan_checkpoint.py). Oracle: torchtitan's forward of the trained model.
- automodel: the torch calls NeMo Automodel's Checkpointer makes for verl's engine (HuggingFaceStorageWriter
  shards, consolidation on every rank, the HF metadata, the optimizer in DCP; tests/writers/
  verl_automodel_checkpoint.py). Oracle: transformers' forward of the trained model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.in_process import run_in_process, single_error_line, stdout_in_process
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.skips import need_torchtitan
from tests.helpers.weights import load_safetensors_folder

pytestmark = pytest.mark.slow

TOKENS = [[1, 5, 7, 9, 11, 3, 42, 100]]  # both writers' TOKENS
STEP = 3


def _logits(folder: Path) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits


@pytest.fixture(scope="session")
def torchtitan_ppo(tmp_path_factory) -> Path:
    """ROOT/ckpt/global_step_3/step-3 as verl's PPO trainer leaves it (no actor/), ROOT/hf, ROOT/logits.pt."""
    need_torchtitan()
    root = tmp_path_factory.mktemp("verl_torchtitan")
    run_writer("verl_torchtitan_checkpoint.py", "--local_path", root / "ckpt" / f"global_step_{STEP}" / "actor",
               "--step", STEP, "--hf", root / "hf", "--logits", root / "logits.pt", nproc=2)
    return root


def test_torchtitan_save_lies_beside_actor_and_merges_from_it(torchtitan_ppo, tmp_path):
    step_dir = torchtitan_ppo / "ckpt" / f"global_step_{STEP}"
    assert sorted(p.name for p in step_dir.iterdir()) == [f"step-{STEP}"]  # where torchtitan put it
    proc = run_merger("merge", "--local_dir", step_dir / "actor", "--target_dir", tmp_path / "out",
                      "--hf_model_config_path", torchtitan_ppo / "hf", "--dtype", "float32")
    assert "merger: torchtitan qwen3 names, written as HF qwen3" in proc.stderr
    titan = torch.load(torchtitan_ppo / "logits.pt", weights_only=True)
    assert (_logits(tmp_path / "out") - titan).abs().max().item() < 1e-4


def test_torchtitan_global_step_folder_under_torchrun_equals_one_process(torchtitan_ppo, tmp_path):
    step_dir = torchtitan_ppo / "ckpt" / f"global_step_{STEP}"
    flags = ("--hf_model_config_path", torchtitan_ppo / "hf", "--dtype", "float32", "--max_shard_size", "20KB")
    run_in_process("merge", "--local_dir", step_dir / "actor", "--target_dir", tmp_path / "one", *flags)
    run_merger("merge", "--local_dir", step_dir, "--target_dir", tmp_path / "three", *flags, nproc=3)
    one, three = load_safetensors_folder(tmp_path / "one"), load_safetensors_folder(tmp_path / "three")
    assert one.keys() == three.keys() and all(torch.equal(one[n], three[n]) for n in one)


def test_torchtitan_inspect_names_the_folder_read(torchtitan_ppo, capsys):
    step_dir = torchtitan_ppo / "ckpt" / f"global_step_{STEP}"
    info = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", step_dir / "actor", "--hf_model_config_path",
                                        torchtitan_ppo / "hf", "--json"))
    assert info["root"] == str(step_dir / f"step-{STEP}")
    assert info["verl_engine"] == (f"torchtitan: global_step_{STEP}/step-{STEP}/ (saved for global_step_N/actor: "
                                   f"the PPO trainer's)")
    assert info["tensors"] == 25  # the model's; optimizer, scheduler and train state are left out


def test_torchtitan_sft_layout_found_from_global_step(torchtitan_ppo, tmp_path, capsys):
    """verl's SFT trainer passes global_step_N itself: torchtitan's step-N lands beside it."""
    ckpt = tmp_path / "ckpt"
    (ckpt / f"global_step_{STEP}").mkdir(parents=True)
    shutil.copytree(torchtitan_ppo / "ckpt" / f"global_step_{STEP}" / f"step-{STEP}", ckpt / f"step-{STEP}")
    said = stdout_in_process(capsys, "inspect", "--local_dir", ckpt / f"global_step_{STEP}", "--hf_model_config_path",
                             torchtitan_ppo / "hf", "--json")
    assert json.loads(said)["root"] == str(ckpt / f"step-{STEP}")


def test_torchtitan_without_config_names_the_option(torchtitan_ppo, tmp_path):
    step_dir = torchtitan_ppo / "ckpt" / f"global_step_{STEP}"
    proc = run_merger("merge", "--local_dir", step_dir / "actor", "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == os.EX_NOINPUT and not (tmp_path / "out").exists()
    assert single_error_line(proc.stderr) == (f"merger: error: no HF config folder found beside the checkpoint "
                                              f"(pass --hf_model_config_path), {step_dir / f'step-{STEP}'}")


def test_torchtitan_actor_with_no_save_beside_it_is_refused(tmp_path):
    """An actor/ path that does not exist and no step-N beside it: the plain error, naming the folder."""
    (tmp_path / "global_step_4").mkdir()
    proc = run_merger("merge", "--local_dir", tmp_path / "global_step_4" / "actor", "--target_dir", tmp_path / "out",
                      check=False)
    assert proc.returncode == os.EX_NOINPUT
    assert single_error_line(proc.stderr) == (f"merger: error: checkpoint folder does not exist, "
                                              f"{tmp_path / 'global_step_4' / 'actor'}")


@pytest.fixture(scope="session")
def automodel_actor(tmp_path_factory) -> Path:
    """ROOT/global_step_2/actor as verl's automodel engine saves it, ROOT/logits.pt."""
    root = tmp_path_factory.mktemp("verl_automodel")
    run_writer("verl_automodel_checkpoint.py", "--actor", root / "global_step_2" / "actor", "--logits",
               root / "logits.pt", nproc=2)
    return root / "global_step_2" / "actor"


def test_automodel_consolidated_merges_from_actor(automodel_actor, tmp_path):
    proc = run_merger("merge", "--local_dir", automodel_actor, "--target_dir", tmp_path / "out", "--dtype", "float32",
                      nproc=2)
    assert "hf_safetensors checkpoint, 26 tensors" in proc.stderr  # the tied lm_head is not saved, nor written
    oracle = torch.load(automodel_actor.parent.parent / "logits.pt", weights_only=True)
    assert (_logits(tmp_path / "out") - oracle).abs().max().item() < 1e-5
    # the consolidated tensors, byte for byte: merger wrote what Automodel's consolidation did
    written, consolidated = load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(
        automodel_actor / "model" / "consolidated")
    assert written.keys() == consolidated.keys() and all(torch.equal(written[n], consolidated[n]) for n in written)


def test_automodel_inspect_names_what_is_skipped(automodel_actor, capsys):
    info = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", automodel_actor, "--json"))
    assert info["verl_engine"] == "automodel: model/consolidated/ (HF safetensors)"
    assert info["skipped"] == {"optim/": "optimizer and scheduler state (automodel engine)",
                               "model/shard-*.safetensors": "the same tensors before consolidation (automodel engine)"}


def test_automodel_found_from_its_model_folder_and_strays_named(automodel_actor, tmp_path, capsys):
    """actor/model/ leads to the same save; files its Checkpointer does not write are listed, not read."""
    actor = tmp_path / "actor"
    shutil.copytree(automodel_actor, actor)
    (actor / "notes.txt").write_text("mine")
    (actor / "model" / "extra.safetensors").write_bytes(b"")
    info = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", actor / "model", "--json"))
    assert info["root"] == str(actor / "model" / "consolidated") and info["tensors"] == 26
    stray = "not written by verl's automodel engine, left alone"
    assert info["skipped"]["notes.txt"] == stray and info["skipped"]["model/extra.safetensors"] == stray


def test_automodel_unconsolidated_shards_merge_with_hf_metadata_config(automodel_actor, tmp_path):
    """No consolidated/ (a save stopped before consolidation): the shards, with .hf_metadata/'s config."""
    actor = tmp_path / "actor"
    shutil.copytree(automodel_actor, actor, ignore=shutil.ignore_patterns("consolidated"))
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32")
    assert "dcp_hf checkpoint" in proc.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen2"
    oracle = torch.load(automodel_actor.parent.parent / "logits.pt", weights_only=True)
    assert (_logits(tmp_path / "out") - oracle).abs().max().item() < 1e-5


@pytest.mark.parametrize("lost, why", [
    (("model.safetensors.index.json", "model-00002-of-00002.safetensors"), "consolidation incomplete (13 of 26 "
                                                                           "tensors missing, e.g. model.layers.1."),
    (("model-00002-of-00002.safetensors",), "consolidation unreadable (safetensors file is missing, "),
])
def test_automodel_cut_short_consolidation_reads_the_shards(automodel_actor, tmp_path, lost, why, capsys):
    """A consolidation that died before its second file (and the index): the shards are read, and inspect says
    why."""
    actor = tmp_path / "actor"
    shutil.copytree(automodel_actor, actor)
    for name in lost:
        (actor / "model" / "consolidated" / name).unlink()
    info = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", actor, "--json"))
    assert info["format"] == "dcp_hf" and info["root"] == str(actor / "model")
    assert info["skipped"]["model/consolidated/"].startswith(why), info["skipped"]


def test_automodel_without_weights_is_refused(automodel_actor, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(automodel_actor, actor)
    for weights in [*actor.glob("model/shard-*.safetensors"), *actor.glob("model/consolidated/model*")]:
        weights.unlink()
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert single_error_line(proc.stderr) == (
        f"merger: error: verl automodel save holds no weights (no model/consolidated/*.safetensors and no "
        f"model/shard-*-model-*-of-*.safetensors), {actor / 'model'}")
