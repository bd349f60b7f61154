"""verl's current Megatron layout (schema v2): `ckpt_contents.json`, `model/{dist_ckpt,huggingface}`, and the
LoRA adapter a Megatron-Bridge run leaves in `model/huggingface/adapter/` or only as shards in `model/dist_ckpt/`.

The model checkpoints come from megatron-core (tests/writers/megatron_checkpoint.py; oracle: Megatron's own
forward logits), the Megatron-named adapter shards too, with Megatron's forward of the model with its adapters
live as the oracle (tests/writers/megatron_lora_adapters.py), the exported LoRA runs from
tests/writers/verl_megatron_lora.py (the adapter by PEFT's save_pretrained; oracle: PEFT's merge_and_unload and
the PeftModel's logits; why not Megatron-Bridge: see there). The manifests are laid out as verl's
MegatronCheckpointManager._build_checkpoint_manifest writes them.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

from tests.helpers.in_process import merge_here, single_error_line
from tests.helpers.in_process import merge_in_process as merge
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.writers.verl_megatron_lora import DIST, HF, LORA_DIST, TOKENS, write_actor, write_manifest, write_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def megatron_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_v2")
    run_writer("megatron_checkpoint.py", "--out", root, "--case", "gqa:arch=qwen2,tp=2", "--case",
               f"lora:arch=qwen2,tp=2,lora={RANK},alpha={ALPHA}", nproc=2)
    return root


RANK, ALPHA = 4, 12  # scale 3: the adapters move the logits far more than the bound


@pytest.fixture(scope="module")
def lora_base(megatron_root, tmp_path_factory) -> Path:
    """The lora case's base model as HF weights (mbridge's model/huggingface/): merged from its Megatron shards,
    which test_megatron.py checks against Megatron's logits."""
    return merge(megatron_root / "lora" / "dist", tmp_path_factory.mktemp("lora_base") / "base", "--dtype", "float32",
                 "--hf_model_config_path", megatron_root / "lora" / "hf")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_lora")
    write_run(root)
    return root


def logits(folder: Path, adapter: Path | None = None) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def test_manifest_locates_the_dist_ckpt(megatron_root, tmp_path):
    """contents.model names Megatron shards: merged from there, reproducing Megatron's logits."""
    actor = tmp_path / "actor"
    shutil.copytree(megatron_root / "gqa" / "dist" / "iter_0000001", actor / "model" / "dist_ckpt")
    shutil.copytree(megatron_root / "gqa" / "hf", actor / "model" / "huggingface")
    write_manifest(actor, {"model": DIST, "hf_config": HF}, dist=True)
    out = merge(actor, tmp_path / "out", "--dtype", "float32")
    oracle = torch.load(megatron_root / "gqa" / "logits.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        got = model.eval()(oracle["tokens"]).logits
    assert (got - oracle["logits"]).abs().max().item() < 1e-4


def test_manifest_hf_weights_without_model_dist_ckpt(lora_run, tmp_path):
    """verl's default with mbridge: the weights in model/huggingface/, no model/dist_ckpt/ at all."""
    actor = tmp_path / "actor"
    shutil.copytree(lora_run / "base", actor / "model" / "huggingface")
    (actor / "optimizer" / "dist_ckpt").mkdir(parents=True)
    write_manifest(actor, {"model": HF, "hf_config": HF})
    out = merge(actor, tmp_path / "out", "--dtype", "float32")
    assert_same_weights(out, lora_run / "base", torch.float32)


def test_newer_layout_without_manifest_warns(megatron_root, tmp_path, capsys):
    """No ckpt_contents.json in the model/ layout: verl writes it last, so the save may be unfinished; the merge
    says so loudly and goes on (every file it reads is checked)."""
    actor = tmp_path / "actor"
    shutil.copytree(megatron_root / "gqa" / "dist" / "iter_0000001", actor / "model" / "dist_ckpt")
    shutil.copytree(megatron_root / "gqa" / "hf", actor / "model" / "huggingface")
    result = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32")
    assert "merger: warning: no ckpt_contents.json" in result.stderr
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("entry", ["model", "peft_adapter_path"])
def test_manifest_path_that_does_not_exist(lora_run, tmp_path, entry):
    actor = write_actor(lora_run, tmp_path, base_weights=True)
    shutil.rmtree(actor / "model" / "huggingface" / ("adapter" if entry == "peft_adapter_path" else ""))
    result = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    line = single_error_line(result.stderr)
    assert "does not exist" in line and line.endswith(str(actor / "ckpt_contents.json")), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["named", "linked"])
def test_manifest_path_outside_the_checkpoint(lora_run, tmp_path, how):
    """The model folder ckpt_contents.json names must lie inside the checkpoint: `../`, or a link leading out."""
    actor = write_actor(lora_run, tmp_path, base_weights=True)
    outside = (actor / "model" / "huggingface").rename(tmp_path / "elsewhere")
    if how == "linked":
        (actor / "model" / "huggingface").symlink_to(outside)
        name = "model/huggingface"
    else:
        name = "../elsewhere"
        write_manifest(actor, {"model": {**HF, "path": name}, "hf_config": {**HF, "path": name}}, peft_on=True)
    result = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", check=False)
    assert result.returncode == 1
    line = single_error_line(result.stderr)
    assert f"names '{name}', which lies outside the checkpoint folder" in line, line
    assert line.endswith(str(actor / "ckpt_contents.json")) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_lora_adapter_folded_into_hf_weights(lora_run, megatron_root, tmp_path, nproc):
    """mbridge wrote base weights beside the exported adapter: merged as PEFT's merge_and_unload, under torchrun
    too; the Megatron-named adapter shards in dist_ckpt/ are the same adapter and are not read."""
    actor = write_actor(lora_run, tmp_path, base_weights=True,
                       adapter_shards=megatron_root / "lora" / "lora_dist" / "iter_0000001")
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32", nproc=nproc)
    ours, want = load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(lora_run / "reference")
    assert sorted(ours) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name  # the same fp32 arithmetic as PEFT: bit for bit
    torch.testing.assert_close(logits(tmp_path / "out"), torch.load(lora_run / "logits.pt"), atol=1e-5, rtol=1e-5)
    assert (tmp_path / "out" / "lora_adapter" / "adapter_config.json").is_file()


def test_lora_without_base_weights(lora_run, tmp_path):
    """Megatron-Bridge writes only the adapter into model/huggingface/: the target is a PEFT adapter folder;
    with --base_model (the model the run started from) the adapter is folded into it."""
    actor = write_actor(lora_run, tmp_path, base_weights=False)
    merge(actor, tmp_path / "adapter_out")
    torch.testing.assert_close(logits(lora_run / "base", tmp_path / "adapter_out"), torch.load(lora_run / "logits.pt"),
                               atol=1e-5, rtol=1e-5)
    merge(actor, tmp_path / "folded", "--base_model", lora_run / "base", "--dtype", "float32")
    assert_same_weights(tmp_path / "folded", lora_run / "reference", torch.float32)


def test_lora_separate_keeps_the_base(lora_run, tmp_path):
    actor = write_actor(lora_run, tmp_path, base_weights=True)
    out = merge(actor, tmp_path / "out", "--lora", "separate", "--dtype", "float32")
    assert_same_weights(out, lora_run / "base", torch.float32)
    torch.testing.assert_close(logits(out, out / "lora_adapter"), torch.load(lora_run / "logits.pt"),
                               atol=1e-5, rtol=1e-5)


def shards_actor(megatron_root: Path, where: Path, base: Path | None) -> Path:
    """A verl actor whose LoRA adapter is only in Megatron-Bridge's shards in model/dist_ckpt/, with the base
    weights in model/huggingface/ (`base`) or only the config and tokenizer there."""
    actor = where / "actor"
    shutil.copytree(megatron_root / "lora" / "lora_dist" / "iter_0000001", actor / "model" / "dist_ckpt")
    shutil.copytree(base or megatron_root / "lora" / "hf", actor / "model" / "huggingface")
    (actor / "optimizer" / "dist_ckpt").mkdir(parents=True)
    write_manifest(actor, {"model": HF, "hf_config": HF, "peft_adapters": LORA_DIST}, peft_on=True)
    return actor


def assert_megatron_logits(megatron_root: Path, folder: Path, adapter: Path | None = None) -> None:
    """Transformers' logits of `folder` (with `adapter` through PEFT) against Megatron's forward of the model with
    its LoRA adapters live."""
    oracle = torch.load(megatron_root / "lora" / "logits.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        got = model.eval()(oracle["tokens"]).logits
    assert (got - oracle["logits"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("nproc", [1, 2])
def test_megatron_adapter_shards_folded(megatron_root, lora_base, tmp_path, nproc):
    """Only Megatron-named adapter shards (TP2: q/k/v per query group and gate/up in their rows): folded into the
    HF base weights, under torchrun too; lora_adapter/ is the same adapter under PEFT's HF names."""
    actor = shards_actor(megatron_root, tmp_path, lora_base)
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32",
               "--lora_alpha", ALPHA, nproc=nproc)
    assert_megatron_logits(megatron_root, tmp_path / "out")
    assert_megatron_logits(megatron_root, lora_base, tmp_path / "out" / "lora_adapter")


def test_megatron_adapter_shards_without_base_weights(megatron_root, lora_base, tmp_path):
    """No base weights in model/huggingface/: the target is a PEFT adapter folder with HF names; --base_model
    folds the shards into the model the run started from (alpha from --adapter_config there), --lora separate
    writes that model as it is."""
    actor = shards_actor(megatron_root, tmp_path, None)
    merge(actor, tmp_path / "adapter", "--lora_alpha", ALPHA, "--lora_r", RANK)
    assert_megatron_logits(megatron_root, lora_base, tmp_path / "adapter")
    # lora_alpha from an adapter_config.json (PEFT's, as Megatron-Bridge's export writes it) instead of the flag
    peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"]).save_pretrained(tmp_path / "config")
    merge(actor, tmp_path / "folded", "--adapter_config", tmp_path / "config", "--base_model", lora_base,
          "--dtype", "float32")
    assert_megatron_logits(megatron_root, tmp_path / "folded")
    merge(actor, tmp_path / "apart", "--lora_alpha", ALPHA, "--base_model", lora_base, "--dtype", "float32",
          "--lora", "separate")
    assert_same_weights(tmp_path / "apart", lora_base, torch.float32)
    assert_megatron_logits(megatron_root, tmp_path / "apart", tmp_path / "apart" / "lora_adapter")


@pytest.mark.parametrize("nproc", [1, 2])
def test_megatron_adapter_shards_beside_the_model_shards(megatron_root, lora_base, tmp_path, nproc):
    """use_dist_checkpointing: the dist_ckpt holds the model's Megatron shards and its adapter shards, no HF
    weights: the adapter is added to each Megatron weight before its q/k/v or gate/up split; --lora separate
    writes the model as it is, with the adapter beside."""
    actor = tmp_path / "actor"
    shutil.copytree(megatron_root / "lora" / "lora_model_dist" / "iter_0000001", actor / "model" / "dist_ckpt")
    shutil.copytree(megatron_root / "lora" / "hf", actor / "model" / "huggingface")
    write_manifest(actor, {"model": DIST, "hf_config": HF}, peft_on=True, dist=True)
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", "float32",
               "--lora_alpha", ALPHA, nproc=nproc)
    assert_megatron_logits(megatron_root, tmp_path / "out")
    if nproc == 1:
        merge(actor, tmp_path / "apart", "--lora_alpha", ALPHA, "--dtype", "float32", "--lora", "separate")
        assert_same_weights(tmp_path / "apart", lora_base, torch.float32)
        assert_megatron_logits(megatron_root, tmp_path / "apart", tmp_path / "apart" / "lora_adapter")


@pytest.mark.parametrize("flags, wanted", [((), "pass --lora_alpha"), (("--lora_alpha", "12", "--lora_r", "8"),
                                                                        "r 8 (--lora_r")])
def test_megatron_adapter_shards_need_lora_alpha(megatron_root, lora_base, tmp_path, flags, wanted):
    """The shards record no lora_alpha: without the flag, one error line asking for it, and no target; an r the
    shapes contradict is an error too."""
    actor = shards_actor(megatron_root, tmp_path, lora_base)
    result = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", *flags, check=False)
    line = single_error_line(result.stderr)
    assert wanted in line and line.endswith(str(actor / "model" / "dist_ckpt")), line
    assert result.returncode != 0 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_megatron_dora_shards_are_refused(megatron_root, tmp_path):
    """A DoRA adapter (Megatron-Bridge's `adapter.weight_magnitude` beside linear_in / linear_out) is not plain
    LoRA: an error naming the shard, never a fold that leaves the magnitude out. The shards are written by torch's
    DCP under megatron-core's torch_dist marker, per-layer keys as Megatron saves unstacked layers."""
    import torch.distributed.checkpoint as dcp

    actor = tmp_path / "actor"
    dist_ckpt = actor / "model" / "dist_ckpt"
    linear = "decoder.layers.0.self_attention.linear_qkv.adapter."
    dcp.save({linear + "linear_in.weight": torch.ones(RANK, 32), linear + "linear_out.weight": torch.ones(64, RANK),
              linear + "weight_magnitude": torch.ones(64)}, checkpoint_id=dist_ckpt, no_dist=True)
    shutil.copy(megatron_root / "lora" / "lora_dist" / "iter_0000001" / "metadata.json", dist_ckpt)
    shutil.copytree(megatron_root / "lora" / "hf", actor / "model" / "huggingface")
    result = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--lora_alpha", ALPHA,
                        check=False)
    line = single_error_line(result.stderr)
    assert "weight_magnitude" in line and line.endswith(str(dist_ckpt)), line
    assert result.returncode != 0 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_lora_flags_the_export_answers_are_refused(lora_run, tmp_path, capsys):
    """r and lora_alpha come from the exported adapter_config.json: a flag that would override them is an error."""
    actor = write_actor(lora_run, tmp_path, base_weights=True)
    code, errors = merge_here(capsys, "--local_dir", actor, "--target_dir", tmp_path / "out", "--lora_alpha", "3")
    assert code != 0 and len(errors) == 1 and "--lora_alpha does not apply" in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_unreadable_manifest(lora_run, tmp_path, capsys):
    actor = write_actor(lora_run, tmp_path, base_weights=True)
    (actor / "ckpt_contents.json").write_text('{"schema_version": 2, "contents": ')  # cut short
    code, errors = merge_here(capsys, "--local_dir", actor, "--target_dir", tmp_path / "out")
    assert code != 0 and len(errors) == 1 and errors[0].endswith(str(actor / "ckpt_contents.json")), errors
