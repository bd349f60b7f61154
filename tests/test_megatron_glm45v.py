"""GLM-4.5V (HF glm4v_moe) Megatron checkpoints merged to HF Glm4vMoeForConditionalGeneration, vision tower
included, checked against Megatron's own forward passes and the vision module the checkpoint was saved from.

tests/writers/megatron_glm45v.py writes one with megatron-core 0.19.2 at TP 2, EP 2 (expert TP 1), legacy and
torch_dist, in Megatron-Bridge's GLM45VModel layout: GLM-4.5's text model as `language_model` (a dense first layer,
then 4 experts behind a sigmoid router with an expert bias, a shared expert; multimodal RoPE on half of each head),
transformers' own Glm4vMoe vision module as `visual`, saved under HF's names and whole on every rank. torch_dist
stacks each layer's experts on one key (`mlp.experts.experts.linear_fc1.weight` [E, ...]).
Oracles (fp32, max abs diff < 1e-4 and the same argmax; the EP ranks' experts are drawn apart, so an expert order
gone wrong moves the logits): Megatron's logits on text tokens; Megatron's logits on text and an image, the
writer's HF vision module's output in place of the image tokens' embeddings, against transformers' own forward of
the merged folder from the pixels; the tower's tensors, bit for bit, those of the module the writer saved. Names
and shapes are those transformers' save_pretrained writes for the config; legacy and torch_dist merge to the same
bytes; the tokenizer, chat template and image processor files are those of the config folder.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.in_process import refused_here
from tests.helpers.legacy_copies import edited_copy
from tests.helpers.megatron_mtp_models import assert_megatron_logits, load_vlm, merged_once, oracle, text_config_folder
from tests.helpers.megatron_vlms import (assert_config_folder_files_copied, assert_image_logits_are_megatrons,
                                        save_pretrained_shapes, write_vlm_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASE = "glm45v_tp2_ep2"
CASES = {CASE: "tp=2,ep=2"}


@pytest.fixture(scope="session")
def glm45v_root(tmp_path_factory):
    import transformers

    return write_vlm_cases(tmp_path_factory, "megatron_glm45v", CASES, "megatron_glm45v.py",
                           transformers.Glm4vImageProcessorPil())  # GLM-4.5V's own, without torchvision


@pytest.fixture(scope="session")
def merged(glm45v_root, tmp_path_factory):
    return merged_once(glm45v_root, tmp_path_factory)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_text_and_image_logits_are_megatrons(fmt, glm45v_root, merged):
    expected = oracle(glm45v_root, CASE)
    model = load_vlm(merged(CASE, fmt))
    assert type(model).__name__ == "Glm4vMoeForConditionalGeneration"
    with torch.no_grad():
        text = model(input_ids=expected["tokens"]).logits
    assert_megatron_logits(text, expected["logits"])
    assert_image_logits_are_megatrons(model, expected)


def test_vision_tower_is_the_module_the_checkpoint_was_saved_from(glm45v_root, merged):
    saved = oracle(glm45v_root, CASE)["visual"]
    ours = {n: t for n, t in load_safetensors_folder(merged(CASE, "dist")).items() if n.startswith("model.visual.")}
    assert sorted(ours) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name


def test_torch_dist_merge_equals_legacy_merge(merged):
    assert_same_weights(merged(CASE, "dist"), merged(CASE, "legacy"), None)


def test_names_and_shapes_are_those_save_pretrained_writes(glm45v_root, merged, tmp_path):
    ours = load_safetensors_folder(merged(CASE, "legacy"))
    assert {n: tuple(t.shape) for n, t in ours.items()} == save_pretrained_shapes(glm45v_root / CASE / "hf", tmp_path)
    # transformers saves GLM-4.5V's experts one by one, as the release holds them
    assert ours["model.language_model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (24, 64)


def test_processor_and_chat_template_files_are_the_config_folders(glm45v_root, merged):
    assert_config_folder_files_copied(glm45v_root / CASE / "hf", merged(CASE, "dist"))


def test_a_checkpoint_without_its_tower_is_refused_in_one_line(glm45v_root, tmp_path, capsys):
    """A run saved without `visual.*` would otherwise be written as a VLM that loads with a random tower."""
    def drop_tower(state):
        state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("visual.")}

    legacy = edited_copy(glm45v_root / CASE / "legacy", tmp_path / "legacy", drop_tower)
    assert refused_here(capsys, tmp_path / "out", "--local_dir", legacy, "--hf_model_config_path",
                        glm45v_root / CASE / "hf") == [
        f"merger: error: the Megatron checkpoint holds no vision tower (visual.*), which HF glm4v_moe is written "
        f"with, {legacy}"]


def test_a_text_models_config_is_refused_in_one_line(glm45v_root, tmp_path, capsys):
    """The text_config alone (glm4v_moe_text) has no place for the tower: the VLM's config.json is needed."""
    src = glm45v_root / CASE / "dist"
    text = text_config_folder(glm45v_root / CASE / "hf", tmp_path / "text")
    assert refused_here(capsys, tmp_path / "out", "--local_dir", src, "--hf_model_config_path", text) == [
        "merger: error: a Megatron vision-language checkpoint (language_model.* tensors and a vision tower's) with "
        "config.json model_type 'glm4v_moe_text': merger writes Megatron VLMs as qwen3_vl, glm4v_moe, qwen3_5, "
        "qwen3_5_moe, qwen3_vl_moe "
        f"(docs/megatron.md; --hf_model_config_path gives the HF VLM's config), {src}"]
