"""LoRA end to end, against PEFT itself: FSDP checkpoints of PEFT-wrapped models (fused and separate, one
process and torchrun; verl's LoRA-only saves too), and `merger lora` folding adapter folders into a HF base. Oracles:
PEFT's merge_and_unload state dict, PeftModel.from_pretrained on the extracted adapter, the unmerged PEFT forward."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from merger.cli import main as merger_main
from tests.helpers.hub_cache import cache_model, offline_env
from tests.helpers.in_process import merge_here
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.writers.peft_adapters import CASES, TOKENS

pytestmark = pytest.mark.slow


def _logits(folder: Path, adapter: Path | None = None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(TOKENS).logits


def _assert_close_fp32(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        assert ours[name].dtype == torch.float32, name
        torch.testing.assert_close(ours[name], want, atol=1e-6, rtol=0, msg=name)


def _assert_bf16_one_step(ours: dict, ref: dict) -> None:
    """Each bf16 value is the fp32 oracle rounded once: at most one bf16 step (2^-7 relative) from it."""
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        assert ours[name].dtype == torch.bfloat16, name
        gap = (ours[name].float() - want.float()).abs()
        assert bool((gap <= want.float().abs() * 2**-7 + 1e-30).all()), name


def _cli(*args) -> int:
    return merger_main([str(a) for a in args])


# ---- FSDP checkpoints of PEFT-wrapped models ---------------------------------------------------------------

def test_fsdp_lora_fused_matches_peft(peft_lora_checkpoint, tmp_path, caplog):
    actor, ref_dir = peft_lora_checkpoint / "global_step_1" / "actor", peft_lora_checkpoint / "reference"
    caplog.set_level(logging.INFO, logger="merger")
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "fp32", "--dtype", "float32") == 0
    # the log says what was found (the writer's r, alpha; 7 linear modules x 2 layers + the embedding) and done
    assert ("LoRA adapter found (r=4, lora_alpha=16, 15 adapted modules): folded into the base weights (--lora fuse); "
            "the adapter goes to lora_adapter/ in the target") in caplog.text
    assert _cli("merge", "--local-dir", actor, "--target-dir", tmp_path / "bf16") == 0
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "ranks2", "--dtype", "float32", nproc=2)
    reference = load_safetensors_folder(ref_dir / "merged")
    _assert_close_fp32(load_safetensors_folder(tmp_path / "fp32"), reference)
    _assert_close_fp32(load_safetensors_folder(tmp_path / "ranks2"), reference)
    _assert_bf16_one_step(load_safetensors_folder(tmp_path / "bf16"), reference)
    # the extracted adapter is a PEFT adapter: loaded onto the base it gives the trained model's logits
    adapter = tmp_path / "fp32" / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["task_type"]) == (4, 16, False, "CAUSAL_LM")
    torch.testing.assert_close(_logits(ref_dir / "base", adapter), torch.load(ref_dir / "logits.pt"),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(tmp_path / "fp32"), torch.load(ref_dir / "logits.pt"), atol=1e-5, rtol=1e-5)


def test_fsdp_lora_separate_and_alpha(peft_lora_checkpoint, tmp_path, capsys, caplog):
    actor, ref_dir = peft_lora_checkpoint / "global_step_1" / "actor", peft_lora_checkpoint / "reference"
    caplog.set_level(logging.INFO, logger="merger")
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "sep", "--dtype", "float32",
                "--lora", "separate") == 0
    assert "the base weights written unfused (--lora separate)" in caplog.text
    ours, base = load_safetensors_folder(tmp_path / "sep"), load_safetensors_folder(ref_dir / "base")
    assert sorted(ours) == sorted(base) and all(torch.equal(ours[n], base[n]) for n in base)
    torch.testing.assert_close(_logits(tmp_path / "sep", tmp_path / "sep" / "lora_adapter"),
                               torch.load(ref_dir / "logits.pt"), atol=1e-5, rtol=1e-5)

    # without lora_train_meta.json alpha is unknown: a clear error, never a silent alpha of 0
    bare = tmp_path / "bare"
    shutil.copytree(actor, bare)
    (bare / "lora_train_meta.json").unlink()
    assert _cli("merge", "--local_dir", bare, "--target_dir", tmp_path / "x") == 1
    assert "lora_alpha is unknown" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "y", "--lora-alpha", "8") == 1
    assert "--lora-alpha 8.0 disagrees with lora_train_meta.json's lora_alpha=16" in capsys.readouterr().err
    assert _cli("merge", "--local_dir", bare, "--target_dir", tmp_path / "flag", "--dtype", "float32",
                "--lora_alpha", "16") == 0
    _assert_close_fp32(load_safetensors_folder(tmp_path / "flag"), load_safetensors_folder(ref_dir / "merged"))


def test_fsdp_lora_adapter_config(peft_lora_checkpoint, tmp_path, capsys):
    """--adapter_config on a whole-model LoRA checkpoint: the config PEFT saved is used as saved; one whose
    lora_alpha contradicts lora_train_meta.json is an error naming both files."""
    actor, ref_dir = peft_lora_checkpoint / "global_step_1" / "actor", peft_lora_checkpoint / "reference"
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32",
                "--adapter_config", ref_dir / "adapter") == 0
    _assert_close_fp32(load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(ref_dir / "merged"))
    saved = json.loads((ref_dir / "adapter" / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "out" / "lora_adapter" / "adapter_config.json").read_text()) == saved
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(saved, lora_alpha=8)))
    code, errors = merge_here(capsys, "--local_dir", actor, "--target_dir", tmp_path / "x", "--adapter_config", other)
    assert code == 1 and len(errors) == 1 and str(actor / "lora_train_meta.json") in errors[0], errors
    assert "lora_alpha=16 but other.json gives lora_alpha=8" in errors[0] and str(other) in errors[0], errors
    # a checkpoint without an adapter: the flag would be ignored, so it is refused
    code, errors = merge_here(capsys, "--local_dir", ref_dir / "merged", "--target_dir", tmp_path / "y",
                              "--adapter_config", ref_dir / "adapter")
    assert code == 1 and errors and "--adapter_config applies to checkpoints with a LoRA adapter" in errors[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ---- verl's LoRA-only saves (checkpoint.save_lora_only=True): the adapter's DTensors and lora_train_meta.json

def _lora_only(root: Path, variant: str) -> tuple[Path, Path]:
    return root / "lora_only" / variant / "global_step_1" / "actor", root / "lora_only" / variant / "reference"


def _assert_peft_adapter(folder: Path, base: Path, ref_dir: Path) -> None:
    """Tensors as PEFT saved them, under its names, bit for bit (PEFT also saves the targeted embedding's base layer,
    which a LoRA-only save does not hold and PEFT does not need); PEFT loads the folder and gives the trained logits."""
    ours, ref = load_safetensors_folder(folder), load_safetensors_folder(ref_dir / "adapter")
    assert sorted(ours) == sorted(n for n in ref if ".base_layer." not in n)
    for name, got in ours.items():
        assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), name
    torch.testing.assert_close(_logits(base, folder), torch.load(ref_dir / "logits.pt"), atol=1e-5, rtol=1e-5)


def test_verl_lora_only_adapter_folder(peft_lora_checkpoint, tmp_path, caplog):
    """No base model: the target is a PEFT adapter folder, r and alpha from lora_train_meta.json, ranks per module
    from the tensors."""
    actor, ref_dir = _lora_only(peft_lora_checkpoint, "plain")
    caplog.set_level(logging.INFO, logger="merger")
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "adapter") == 0
    assert "adapter-only LoRA checkpoint (r=4, lora_alpha=16, rank_pattern for 2 modules" in caplog.text
    _assert_peft_adapter(tmp_path / "adapter", peft_lora_checkpoint / "reference" / "base", ref_dir)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 16, "CAUSAL_LM")
    assert not (tmp_path / "adapter" / "config.json").exists()


def test_verl_lora_only_into_base_torchrun(peft_lora_checkpoint, tmp_path):
    """--base_model: the base with the adapter folded in as merge_and_unload folds it, bit for bit, on 2 ranks."""
    actor, ref_dir = _lora_only(peft_lora_checkpoint, "plain")
    base = peft_lora_checkpoint / "reference" / "base"
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "merged", "--base_model", base,
               "--dtype", "keep", nproc=2)
    assert_same_weights(tmp_path / "merged", ref_dir / "merged", None)
    _assert_peft_adapter(tmp_path / "merged" / "lora_adapter", base, ref_dir)


def test_verl_lora_only_into_a_base_given_as_a_hub_id(peft_lora_checkpoint, tmp_path):
    """--base_model owner/name: the base found in huggingface_hub's cache (laid out as the library does, offline),
    folded into as from the local folder."""
    actor, ref_dir = _lora_only(peft_lora_checkpoint, "plain")
    cache = tmp_path / "hub"
    cache_model(cache, "merger-test/lora-base", peft_lora_checkpoint / "reference" / "base")
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "merged", "--base_model",
               "merger-test/lora-base", "--dtype", "keep", env=offline_env(cache))
    assert_same_weights(tmp_path / "merged", ref_dir / "merged", None)
    config = json.loads((tmp_path / "merged" / "lora_adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "merger-test/lora-base"  # loads anywhere, unlike a cache path

    # The id is no folder of the working directory: a target there named like its owner holds no source.
    (tmp_path / "cwd").mkdir()
    run_merger("merge", "--local_dir", actor, "--target_dir", "merger-test", "--base_model", "merger-test/lora-base",
               "--dtype", "keep", env=offline_env(cache), cwd=tmp_path / "cwd")
    assert_same_weights(tmp_path / "cwd" / "merger-test", ref_dir / "merged", None)


def test_verl_lora_only_adapter_config(peft_lora_checkpoint, tmp_path, capsys, caplog):
    """An adapter with rsLoRA, rank_pattern and alpha_pattern (which lora_train_meta.json cannot record): with
    --adapter_config it merges as PEFT merges it; a meta file that contradicts the config names both files."""
    actor, ref_dir = _lora_only(peft_lora_checkpoint, "rslora")
    base = peft_lora_checkpoint / "reference" / "base"
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "merged", "--base_model", base,
                "--dtype", "keep", "--adapter_config", ref_dir / "adapter" / "adapter_config.json") == 0
    assert_same_weights(tmp_path / "merged", ref_dir / "merged", None)
    _assert_peft_adapter(tmp_path / "merged" / "lora_adapter", base, ref_dir)
    saved = json.loads((ref_dir / "adapter" / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "merged" / "lora_adapter" / "adapter_config.json").read_text()) == saved

    # a config naming modules_to_save, whose copies verl's filter dropped: those modules keep the base's values, the
    # written config leaves them out (PEFT fails to load a folder whose config names weights it lacks), the log says so
    with_saved = tmp_path / "with_saved.json"
    with_saved.write_text(json.dumps(dict(saved, modules_to_save=["model.norm"])))
    caplog.set_level(logging.INFO, logger="merger")
    assert _cli("merge", "--local_dir", actor, "--target_dir", tmp_path / "saved", "--base_model", base,
                "--dtype", "keep", "--adapter_config", with_saved) == 0
    assert "names modules_to_save ['model.norm'], but the checkpoint holds no weights for them" in caplog.text
    assert_same_weights(tmp_path / "saved", ref_dir / "merged", None)
    _assert_peft_adapter(tmp_path / "saved" / "lora_adapter", base, ref_dir)

    other_run = tmp_path / "other_run"
    shutil.copytree(actor, other_run)
    (other_run / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}))
    code, errors = merge_here(capsys, "--local_dir", other_run, "--target_dir", tmp_path / "x",
                              "--adapter_config", ref_dir / "adapter")
    assert code == 1 and len(errors) == 1, errors
    assert "lora_train_meta.json records r=8 but adapter_config.json gives r=4" in errors[0], errors
    assert str(other_run / "lora_train_meta.json") in errors[0] and str(ref_dir / "adapter" / "adapter_config.json") \
        in errors[0], errors
    assert not (tmp_path / "x").exists()


# ---- merger lora: adapter folders into a HF base ---------------------------------------------------------

def _oracle(adapter_cases: Path, case: str) -> dict:
    return torch.load(adapter_cases / case / "oracle.pt", weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_into_base_matches_peft(adapter_cases, tmp_path, case):
    """All adapters of the case applied in order; each against PEFT merging them one after another."""
    root, oracle = adapter_cases / case, _oracle(adapter_cases, case)
    adapters = [a for name, _, _ in CASES[case][2] for a in ("--adapter", root / name)]
    assert _cli("lora", "--base", root / "base", *adapters, "--target_dir", tmp_path / "out") == 0
    last = len(CASES[case][2]) - 1
    ours, merged = load_safetensors_folder(tmp_path / "out"), oracle[f"merged_{last}"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if case == "tied":
        # PEFT folds a LoRA on a tied lm_head into the shared tensor, changing the input embedding too; the
        # faithful standalone model unties them: its logits are the unmerged PEFT model's.
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in ours
    else:
        assert config.get("tie_word_embeddings", True) == oracle[f"tied_{last}"]
        if oracle[f"tied_{last}"]:
            merged = {n: t for n, t in merged.items() if n != "lm_head.weight"}  # written once, as save_pretrained
        assert sorted(ours) == sorted(merged)
        for name, want in merged.items():
            assert torch.equal(ours[name], want), name  # same fp32 arithmetic as PEFT: bit for bit
    torch.testing.assert_close(_logits(tmp_path / "out"), oracle[f"logits_{last}"], atol=1e-5, rtol=1e-5)


def test_lora_torchrun_bf16(adapter_cases, tmp_path):
    root, oracle = adapter_cases / "llama", _oracle(adapter_cases, "llama")
    run_merger("lora", "--base", root / "base", "--adapter", root / "patterns", "--adapter", root / "dora",
               "--target_dir", tmp_path / "out", "--dtype", "bfloat16", "--max_shard_size", "40KB", nproc=2)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    _assert_bf16_one_step(load_safetensors_folder(tmp_path / "out"), oracle["merged_1"])


def test_lora_adapter_not_fitting_base(adapter_cases, tmp_path, capsys):
    # a GPT-2 adapter on a Llama base: its modules do not exist there
    assert _cli("lora", "--base", adapter_cases / "llama" / "base", "--adapter", adapter_cases / "gpt2" / "conv1d",
                "--target_dir", tmp_path / "a") == 1
    assert "has no base tensor transformer.h.0.attn.c_attn.weight" in capsys.readouterr().err
    # an adapter trained on a wider model: shapes do not fit
    assert _cli("lora", "--base", adapter_cases / "wide", "--adapter", adapter_cases / "llama" / "dora",
                "--target_dir", tmp_path / "b") == 1
    err = capsys.readouterr().err
    assert "do not fit base tensor model.layers.0." in err and "base_model.model.model.layers.0." in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # a LoRA variant with another merge rule is refused, not folded as plain LoRA
    variant = tmp_path / "variant"
    shutil.copytree(adapter_cases / "tied" / "head", variant)
    config = json.loads((variant / "adapter_config.json").read_text())
    (variant / "adapter_config.json").write_text(json.dumps(dict(config, use_bdlora={"nblocks": 2})))
    assert _cli("lora", "--base", adapter_cases / "tied" / "base", "--adapter", variant,
                "--target_dir", tmp_path / "c") == 1
    assert "adapter uses use_bdlora" in capsys.readouterr().err
