"""Qwen3.5 and Qwen3.5-MoE VLM (HF qwen3_5, qwen3_5_moe) Megatron checkpoints merged to HF
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, vision tower included, checked against
Megatron's own forward passes.

tests/writers/megatron_qwen3_5_vl.py writes both with megatron-core 0.19.2 at TP 2 (the MoE one with EP 2, expert TP
1), legacy and torch_dist, in Megatron-Bridge's layout for Qwen3.5 (its Qwen3VLModel) rebuilt on megatron-core's local
modules: the Gated DeltaNet hybrid text model as `language_model` (megatron_gdn.py's: a Gated DeltaNet layer, then
gated full attention; dense, or 4 routed experts and a gated shared expert), Qwen3-VL's vision tower as
`vision_model` without deepstack mergers (megatron_qwen3_vl.py's).
Oracles, all Megatron's own forwards against transformers' forward of the merged folder (fp32, max abs diff < 1e-4):
the language model's logits on text tokens (and the same argmax); the vision blocks over a patch sequence, the same
rotary table given to both; the patch merger; the patch embedding. Names and shapes are those transformers'
save_pretrained writes for the config; legacy and torch_dist merge to the same bytes; the tokenizer, chat template and
image processor files are those of the config folder. Two experts taken for each other, or the vision qkv left in
Megatron's per-head order, fail these checks.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import refused_here
from tests.helpers.legacy_copies import edited_copy
from tests.helpers.megatron_mtp_models import assert_megatron_logits, load_vlm, merged_once, oracle, text_config_folder
from tests.helpers.megatron_vlms import (assert_config_folder_files_copied, assert_tower_is_megatrons,
                                        save_pretrained_shapes, write_vlm_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.writers.tiny_models import build_image_processor

pytestmark = pytest.mark.slow

CASE, MOE_CASE = "qwen3_5_vl_tp2", "qwen3_5_moe_vl_tp2_ep2"
CASES = {CASE: "tp=2,pattern=lf", MOE_CASE: "arch=qwen3_5_moe_text,moe=1,ep=2,pattern=lf"}


@pytest.fixture(scope="session")
def vl_root(tmp_path_factory):
    return write_vlm_cases(tmp_path_factory, "megatron_qwen3_5_vl", CASES, "megatron_qwen3_5_vl.py",
                           build_image_processor())


@pytest.fixture(scope="session")
def merged(vl_root, tmp_path_factory):
    return merged_once(vl_root, tmp_path_factory)


def _text_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_text_logits_are_megatrons(case, fmt, vl_root, merged):
    expected = oracle(vl_root, case)
    assert_megatron_logits(_text_logits(load_vlm(merged(case, fmt)), expected["tokens"]), expected["logits"])


@pytest.mark.parametrize("case", CASES)
def test_vision_tower_modules_compute_what_megatrons_do(case, vl_root, merged):
    assert_tower_is_megatrons(load_vlm(merged(case, "dist")).model.visual, oracle(vl_root, case))


def test_two_experts_taken_for_each_other_fail_the_logits_check(vl_root, merged):
    """Experts 0 and 2 (one from each EP rank's file) swapped in every MoE layer: the check the merge passes fails."""
    expected = oracle(vl_root, MOE_CASE)
    model = load_vlm(merged(MOE_CASE, "dist"))
    for layer in model.model.language_model.layers:
        for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            param.data[[0, 2]] = param.data[[2, 0]].clone()
    with pytest.raises(AssertionError):
        assert_megatron_logits(_text_logits(model, expected["tokens"]), expected["logits"])


def test_vision_qkv_in_megatrons_per_head_order_fails_the_tower_check(vl_root, merged):
    """Each block's qkv rows left as Megatron holds them (per head [q; k; v]) rather than HF's [all q; all k; all v]."""
    expected = oracle(vl_root, CASE)
    visual = load_vlm(merged(CASE, "dist")).model.visual
    for block in visual.blocks:
        heads = block.attn.num_heads
        for param in (block.attn.qkv.weight, block.attn.qkv.bias):
            hf = param.data.reshape(3, heads, -1, *param.shape[1:])
            param.data = hf.transpose(0, 1).reshape(param.shape).clone()
    with pytest.raises(AssertionError):
        assert_tower_is_megatrons(visual, expected)


@pytest.mark.parametrize("case", CASES)
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", CASES)
def test_names_and_shapes_are_those_save_pretrained_writes(case, vl_root, merged, tmp_path):
    ours = load_safetensors_folder(merged(case, "legacy"))
    assert {n: tuple(t.shape) for n, t in ours.items()} == save_pretrained_shapes(vl_root / case / "hf", tmp_path)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in ours
    assert not any("deepstack" in n for n in ours)
    if case == MOE_CASE:  # transformers saves Qwen3.5-MoE's experts one by one
        assert ours["model.language_model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (24, 64)


def test_processor_and_chat_template_files_are_the_config_folders(vl_root, merged):
    assert_config_folder_files_copied(vl_root / MOE_CASE / "hf", merged(MOE_CASE, "dist"))


def test_a_checkpoint_without_its_tower_is_refused_in_one_line(vl_root, tmp_path, capsys):
    """A run saved with `language_model.*` alone would otherwise be written as a VLM that loads with a random tower."""
    def drop_tower(state):
        state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("vision_model.")}

    legacy = edited_copy(vl_root / CASE / "legacy", tmp_path / "legacy", drop_tower)
    assert refused_here(capsys, tmp_path / "out", "--local_dir", legacy, "--hf_model_config_path",
                        vl_root / CASE / "hf") == [
        f"merger: error: the Megatron checkpoint holds no vision tower (vision_model.*), which HF qwen3_5 is written "
        f"with, {legacy}"]


def test_a_text_models_config_is_refused_in_one_line(vl_root, tmp_path, capsys):
    """The text_config alone (qwen3_5_moe_text) has no place for the tower: the VLM's config.json is needed."""
    src = vl_root / MOE_CASE / "dist"
    text = text_config_folder(vl_root / MOE_CASE / "hf", tmp_path / "text")
    assert refused_here(capsys, tmp_path / "out", "--local_dir", src, "--hf_model_config_path", text) == [
        "merger: error: a Megatron vision-language checkpoint (language_model.* tensors and a vision tower's) with "
        "config.json model_type 'qwen3_5_moe_text': merger writes Megatron VLMs as qwen3_vl, glm4v_moe, qwen3_5, "
        f"qwen3_5_moe, qwen3_vl_moe (docs/megatron.md; --hf_model_config_path gives the HF VLM's config), {src}"]


def test_text_layer_types_the_checkpoint_does_not_have_are_refused_in_one_line(vl_root, tmp_path, capsys):
    """text_config's layer_types decide which HF module each text layer is: a pattern other than the checkpoint's
    stops the merge, naming the layer, instead of writing weights the VLM would not load."""
    hf = Path(shutil.copytree(vl_root / CASE / "hf", tmp_path / "hf"))
    config = json.loads((hf / "config.json").read_text())
    assert config["text_config"]["layer_types"] == ["linear_attention", "full_attention"]
    config["text_config"]["layer_types"] = ["full_attention", "linear_attention"]
    (hf / "config.json").write_text(json.dumps(config))
    src = vl_root / CASE / "dist"
    assert refused_here(capsys, tmp_path / "out", "--local_dir", src, "--hf_model_config_path", hf) == [
        f"merger: error: layer 0 of the checkpoint is linear_attention but config.json's layer_types[0] is "
        f"'full_attention', {src}"]
