"""Adapter-only DCP checkpoints of PEFT models (accelerate's save_fsdp_model(..., adapter_only=True), as HF Trainer
calls it with FSDP2 SHARDED_STATE_DICT), against PEFT itself.

The checkpoint is written once per session by tests/writers/dcp_peft_checkpoint.py (accelerate, PEFT, FSDP2, 2
gloo ranks). Oracles: PEFT's save_pretrained of the unsharded adapter (tensors bit for bit, and its
adapter_config.json), the unmerged PEFT model's logits, and merge_and_unload's state dict (bit for bit in fp32).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from merger.cli import main as merger_main
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.writers.peft_adapters import TOKENS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def dcp_peft_root(tmp_path_factory) -> Path:
    """output/checkpoint-1/pytorch_model_fsdp_0 (2 ranks), base/, reference/{adapter,merged,logits.pt}."""
    root = tmp_path_factory.mktemp("dcp_peft")
    run_writer("dcp_peft_checkpoint.py", "--out", root, nproc=2)
    return root


def _cli(*args) -> int:
    return merger_main([str(a) for a in args])


def _trainer_output(root: Path, tmp_path: Path, with_config: bool) -> Path:
    """A Trainer output folder holding checkpoint-1/, and the adapter_config.json a final save_model writes."""
    output = tmp_path / "output"
    shutil.copytree(root / "output", output)
    if with_config:
        shutil.copy(root / "reference" / "adapter" / "adapter_config.json", output)
    return output


def _peft_logits(base: Path, adapter: Path) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    with torch.no_grad():
        return model(TOKENS).logits


def _assert_adapter_folder(folder: Path, root: Path) -> None:
    """Tensors equal PEFT's own adapter file bit for bit; PEFT loads the folder and gives the trained logits."""
    ours, ref = load_safetensors_folder(folder), load_safetensors_folder(root / "reference" / "adapter")
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        assert ours[name].dtype == want.dtype and torch.equal(ours[name], want), name
    torch.testing.assert_close(_peft_logits(root / "base", folder), torch.load(root / "reference" / "logits.pt"),
                               atol=1e-5, rtol=1e-5)


def test_adapter_folder_from_flags_one_process(dcp_peft_root, tmp_path):
    """No adapter_config.json anywhere: r, rank_pattern, targets and modules_to_save come from the tensors."""
    output = _trainer_output(dcp_peft_root, tmp_path, with_config=False)
    assert _cli("merge", "--local_dir", output / "checkpoint-1", "--target_dir", tmp_path / "adapter",
                "--lora_alpha", "16") == 0
    _assert_adapter_folder(tmp_path / "adapter", dcp_peft_root)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 16, ["model.norm"])
    assert config["rank_pattern"] == {f"model.layers.{i}.mlp.down_proj": 2 for i in range(2)}
    assert not (tmp_path / "adapter" / "config.json").exists()  # an adapter folder, not a model


def test_adapter_folder_config_from_parent_torchrun(dcp_peft_root, tmp_path):
    """The Trainer's output folder holds adapter_config.json: it is used as saved; 3 merge ranks for a 2-rank save."""
    output = _trainer_output(dcp_peft_root, tmp_path, with_config=True)
    run_merger("merge", "--local_dir", output / "checkpoint-1", "--target_dir", tmp_path / "adapter", "--device",
               "cpu", nproc=3)
    _assert_adapter_folder(tmp_path / "adapter", dcp_peft_root)
    saved = json.loads((dcp_peft_root / "reference" / "adapter" / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == saved


def test_alpha_unknown_or_contradicted_is_an_error(dcp_peft_root, tmp_path, capsys):
    bare = _trainer_output(dcp_peft_root, tmp_path / "bare", with_config=False)
    assert _cli("merge", "--local_dir", bare / "checkpoint-1", "--target_dir", tmp_path / "x") == 1
    err = capsys.readouterr().err
    assert "merger: error:" in err and "lora_alpha is unknown" in err and "--lora-alpha" in err, err
    assert not (tmp_path / "x").exists()

    output = _trainer_output(dcp_peft_root, tmp_path / "with_config", with_config=True)
    assert _cli("merge", "--local_dir", output / "checkpoint-1", "--target_dir", tmp_path / "y",
                "--lora-alpha", "8") == 1
    assert "--lora-alpha 8.0 disagrees with adapter_config.json's lora_alpha=16" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()

    # a config from another run (another r) is caught by the tensors' shapes, and the error names that config
    stale = tmp_path / "stale.json"
    saved = json.loads((output / "adapter_config.json").read_text())
    stale.write_text(json.dumps(dict(saved, r=8, rank_pattern={})))
    assert _cli("merge", "--local_dir", output / "checkpoint-1", "--target_dir", tmp_path / "z",
                "--adapter_config", stale) == 1
    err = capsys.readouterr().err
    assert "has rank 4 but the adapter config gives module" in err and str(stale) in err, err


def test_flags_that_do_not_apply_are_errors(dcp_peft_root, tmp_path, capsys):
    output = _trainer_output(dcp_peft_root, tmp_path, with_config=True)
    assert _cli("merge", "--local_dir", output / "checkpoint-1", "--target_dir", tmp_path / "x", "--verify") == 1
    assert "--verify checks a merged model; the output here is an adapter folder" in capsys.readouterr().err
    base = dcp_peft_root / "base"  # a whole model: --base_model would be silently ignored
    assert _cli("merge", "--local_dir", base, "--target_dir", tmp_path / "y", "--base_model", base) == 1
    assert "--base_model applies to adapter-only checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_base_model_gives_the_merged_model(dcp_peft_root, tmp_path):
    """--base_model folds the adapter as merge_and_unload does (bit for bit in fp32), config and tokenizer from
    the base, the adapter beside it in lora_adapter/; --adapter-config names the config by hand."""
    output = _trainer_output(dcp_peft_root, tmp_path, with_config=False)
    assert _cli("merge", "--local-dir", output / "checkpoint-1", "--target-dir", tmp_path / "merged", "--dtype", "keep",
                "--base-model", dcp_peft_root / "base",
                "--adapter-config", dcp_peft_root / "reference" / "adapter" / "adapter_config.json") == 0
    assert_same_weights(tmp_path / "merged", dcp_peft_root / "reference" / "merged", None)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    _assert_adapter_folder(tmp_path / "merged" / "lora_adapter", dcp_peft_root)
