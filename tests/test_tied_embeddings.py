"""Tied embeddings are decided by the checkpoint's values, not by its config alone, and `--verify` checks what
was left out (issue #35, item 1).

Real FSDP2 checkpoints (2 ranks, fully_shard + torch.save, tests/writers/fsdp_checkpoint.py) of the same tiny
Llama untied and tied, merged on 2 ranks so every rank must reach the same decision; the oracle is
each model's own save_pretrained output (lm_head written when untied, left out when tied) and transformers'
loading of ours.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

UNTIES = "both are written, and the output's config.json says tie_word_embeddings: false"


@pytest.fixture(scope="module")
def untied(fsdp_checkpoint):
    return fsdp_checkpoint("llama", world=2)


@pytest.fixture(scope="module")
def tied(fsdp_checkpoint):
    return fsdp_checkpoint("llama", world=2, tied=True)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _merge(actor: Path, out: Path, *extra, check: bool = True):
    return run_merger("merge", "--local_dir", actor, "--target_dir", out, "--verify", *extra, nproc=2, check=check)


def test_a_config_that_ties_a_distinct_lm_head_writes_both_and_unties(untied, tmp_path):
    """An untied checkpoint whose huggingface/config.json was copied from a tied model: the trained lm_head is
    kept, the output's config unties, and the model loads with that head."""
    actor, reference = untied
    lying = tmp_path / "actor"
    shutil.copytree(actor, lying)
    config_path = lying / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    assert config["tie_word_embeddings"] is False
    config_path.write_text(json.dumps({**config, "tie_word_embeddings": True}))

    proc = _merge(lying, tmp_path / "out")
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert "lm_head.weight" in load_safetensors_folder(reference)
    assert _config(tmp_path / "out")["tie_word_embeddings"] is False
    assert UNTIES in proc.stderr and str(config_path) in proc.stderr
    assert "merger verify: PASSED" in proc.stdout

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    want = transformers.AutoModelForCausalLM.from_pretrained(reference).lm_head.weight.to(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, want)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_a_tied_model_is_written_tied(tied, tmp_path):
    """Its checkpoint holds lm_head.weight and embed_tokens.weight, equal: lm_head is left out as save_pretrained
    leaves it out, and --verify compares the source's lm_head with the written embedding."""
    actor, reference = tied
    proc = _merge(actor, tmp_path / "out")
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert "lm_head.weight" not in load_safetensors_folder(reference)
    assert _config(tmp_path / "out").get("tie_word_embeddings", True) is True
    assert UNTIES not in proc.stderr
    written = len(load_safetensors_folder(tmp_path / "out"))
    assert f"merger verify: {written + 1} tensors" in proc.stdout  # lm_head too, against the embedding
    assert "merger verify: PASSED" in proc.stdout

    # `merger test` against save_pretrained's folder (fp32, no lm_head) checks the source's lm_head the same way
    test = run_merger("test", "--local_dir", actor, "--test_hf_dir", reference, nproc=2)
    assert f"merger test: {written + 1} tensors" in test.stdout and "merger test: PASSED" in test.stdout


def test_an_untied_model_is_written_untied(untied, tmp_path):
    actor, reference = untied
    proc = _merge(actor, tmp_path / "out")
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)
    assert _config(tmp_path / "out")["tie_word_embeddings"] is False
    assert UNTIES not in proc.stderr and "merger verify: PASSED" in proc.stdout


def test_verify_fails_when_the_output_lacks_a_source_tensor(untied, tmp_path):
    """--tie_word_embedding ties an untied checkpoint as asked, leaving its distinct lm_head out: the output
    lacks a tensor the source holds, so --verify fails and nothing reaches the target."""
    actor, _ = untied
    proc = _merge(actor, tmp_path / "out", "--tie_word_embedding", check=False)
    assert proc.returncode == 1
    assert "merger verify: FAILED" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("lm_head.weight"))
    assert "left out as tied to model.embed_tokens.weight" in row and "values differ" in row
    assert single_error_line(proc.stderr).startswith("merger: error: the written output failed verification")
    assert not (tmp_path / "out").exists()
