"""Qwen3.5 and Qwen3.5-MoE VLM (HF qwen3_5, qwen3_5_moe) Megatron checkpoints merged to HF
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, vision tower included, checked against
Megatron's own forward passes.

tests/writers/megatron_qwen3_5_vl.py writes both with megatron-core 0.19.2 at TP 2 (the MoE one with EP 2, expert TP
1), legacy and torch_dist, in Megatron-Bridge's layout for Qwen3.5 (its Qwen3VLModel) rebuilt on megatron-core's local
modules: the Gated DeltaNet hybrid text model as `language_model` (megatron_gdn.py's: a Gated DeltaNet layer, then
gated full attention; dense, or 4 routed experts and a gated shared expert), Qwen3-VL's vision tower as
`vision_model` without deepstack mergers (megatron_qwen3_vl.py's).
Oracles, all Megatron's own forwards against transformers' forward of the merged folder (fp32, max abs diff < 1e-4):
the language model's logits on text tokens (and the same argmax); Megatron-Bridge's own Qwen3VLModel's logits on text
and an image, with the hybrid as its text model (and the same argmax; measured within 5.3e-6); the vision blocks over
a patch sequence, the same rotary table given to both; the patch merger; the patch embedding. Names and shapes are those transformers'
save_pretrained writes for the config; legacy and torch_dist merge to the same bytes; the tokenizer, chat template and
image processor files are those of the config folder. Two experts taken for each other, or the vision qkv left in
Megatron's per-head order, fail these checks. A third case has a multi-token-prediction layer, written as the
release holds it (`mtp.*` beside the VLM): its logits, as vLLM's MTP forward computes them from transformers'
modules (test_megatron_gdn.py's mtp_logits on the merged text model), are Megatron's MTP layer's; its own tensors
are Megatron's MTP module's; --drop-mtp leaves it out.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.in_process import refused_here
from tests.helpers.legacy_copies import edited_copy
from tests.helpers.megatron_mtp_models import assert_megatron_logits, load_vlm, merged_once, oracle, text_config_folder
from tests.helpers.megatron_vlms import (assert_config_folder_files_copied, assert_image_logits_are_megatrons,
                                        assert_tower_is_megatrons, save_pretrained_shapes, write_vlm_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.test_megatron_gdn import MTP_OWN, mtp_logits
from tests.writers.tiny_models import build_image_processor

pytestmark = pytest.mark.slow

CASE, MOE_CASE, MTP_CASE = "qwen3_5_vl_tp2", "qwen3_5_moe_vl_tp2_ep2", "qwen3_5_vl_mtp_tp2"
CASES = {CASE: "tp=2,pattern=lf", MOE_CASE: "arch=qwen3_5_moe_text,moe=1,ep=2,pattern=lf",
         MTP_CASE: "tp=2,pattern=lf,mtp=1"}  # a multi-token-prediction layer, written as the release's mtp.*


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
def test_text_and_image_logits_are_megatrons(case, fmt, vl_root, merged):
    """The text logits are the language model's; the text+image logits Megatron-Bridge's own Qwen3VLModel's over the
    saved tensors (megatron_qwen3_vl.py's image oracle: the tower on the pixel patches, its output in place of the
    image pads, MRoPE positions through the hybrid's full-attention layers), against transformers' forward from the
    same tokens, pixels, grid and token types."""
    expected = oracle(vl_root, case)
    model = load_vlm(merged(case, fmt))
    assert_megatron_logits(_text_logits(model, expected["tokens"]), expected["logits"])
    assert_image_logits_are_megatrons(model, expected)


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
    """The VLM's tensors are those save_pretrained writes; an MTP layer's transformer layer (transformers has no
    module for it) has the names and shapes save_pretrained gives a full-attention decoder layer."""
    ours = {n: tuple(t.shape) for n, t in load_safetensors_folder(merged(case, "legacy")).items()}
    own = save_pretrained_shapes(vl_root / case / "hf", tmp_path)
    assert {n: s for n, s in ours.items() if not n.startswith("mtp.")} == own
    full = "model.language_model.layers.1."  # pattern lf
    assert {n[len("mtp.layers.0."):]: s for n, s in ours.items() if n.startswith("mtp.layers.")} == (
        {n[len(full):]: s for n, s in own.items() if n.startswith(full)} if case == MTP_CASE else {})
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in ours
    assert not any("deepstack" in n for n in ours)
    if case == MOE_CASE:  # transformers saves Qwen3.5-MoE's experts one by one
        assert ours["model.language_model.layers.1.mlp.experts.3.gate_proj.weight"] == (24, 64)


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


def _text_model_folder(vlm: Path, dest: Path) -> Path:
    """The merged VLM's text model (and MTP layer) as a Qwen3.5 causal LM folder: its text_config, its tensors under
    the text model's names, the tower left out."""
    dest.mkdir()
    config = json.loads((vlm / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config["text_config"]))
    weights = {n.replace("model.language_model.", "model.", 1): t for n, t in load_safetensors_folder(vlm).items()
               if not n.startswith("model.visual.")}
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_mtp_layer_reproduces_megatron_mtp_logits(vl_root, merged, tmp_path):
    """The MTP layer's logits as vLLM's Qwen3.5 MTP forward computes them from transformers' modules
    (test_megatron_gdn.py's mtp_logits, on the merged text model) are those Megatron's MTP layer gives."""
    expected = oracle(vl_root, MTP_CASE)
    text = _text_model_folder(merged(MTP_CASE, "dist"), tmp_path / "text")
    (tmp_path / "twin").mkdir()
    assert_megatron_logits(mtp_logits(text, expected["tokens"], tmp_path / "twin"), expected["mtp_logits"][0])


def test_mtp_tensors_are_the_megatron_mtp_module(vl_root, merged):
    """The MTP layer's own tensors, as the writer gathered them from megatron-core's module, under the release's
    names; text_config counts the one layer."""
    expected = oracle(vl_root, MTP_CASE)["mtp_params"]
    weights = load_safetensors_folder(merged(MTP_CASE, "legacy"))
    assert sorted(expected) == sorted(f"mtp.layers.0.{n}" for n in MTP_OWN)
    for megatron, hf in MTP_OWN.items():
        assert torch.equal(weights[hf], expected[f"mtp.layers.0.{megatron}"]), hf
    config = json.loads((merged(MTP_CASE, "legacy") / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1


def test_drop_mtp_leaves_the_mtp_layer_out(vl_root, merged):
    """--drop-mtp writes the VLM without its MTP layer: every other tensor the same bytes, text_config counts no MTP
    layer, and the text logits are Megatron's."""
    out, whole = merged(MTP_CASE, "dist", "--drop-mtp"), load_safetensors_folder(merged(MTP_CASE, "dist"))
    got = load_safetensors_folder(out)
    assert sorted(got) == sorted(n for n in whole if not n.startswith("mtp."))
    assert all(torch.equal(t, whole[n]) for n, t in got.items())
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0
    expected = oracle(vl_root, MTP_CASE)
    assert_megatron_logits(_text_logits(load_vlm(out), expected["tokens"]), expected["logits"])
