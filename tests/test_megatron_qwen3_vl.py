"""Qwen3-VL and Qwen3-VL-MoE (HF qwen3_vl, qwen3_vl_moe) Megatron checkpoints merged to HF
Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration, vision tower included, checked against
Megatron's own forward passes.

tests/writers/megatron_qwen3_vl.py writes both with megatron-core 0.19.2 at TP 2 (the MoE one with EP 2, expert TP
1), and Qwen3-VL in 2 pipeline stages (TP 1, 4 text layers, the tower on the first stage, each stage's text layers
numbered from 0 in the legacy files), legacy and torch_dist, in Megatron-Bridge's Qwen3VLModel layout rebuilt on
megatron-core's local modules: the
text model as `language_model` (Qwen3's; Qwen3-VL-MoE's with a dense first layer, then 4 experts transformers keeps
stacked on disk), the vision tower as `vision_model` (patch embedding, position embedding, ViT blocks with a fused
per-head [q; k; v] linear_qkv, two deepstack mergers and the final patch merger, split over TP).
Oracles, all Megatron's own forwards against transformers' forward of the merged folder (fp32, max abs diff < 1e-4;
the MoE text logits depend on which expert is which: the EP ranks' experts are drawn apart):
the language model's logits on text tokens (and the same argmax); Megatron-Bridge's own Qwen3VLModel's logits on
text and a 6 x 4-patch image (and the same argmax; measured within 6e-7, the bridge's patch mergers given HF's exact
GELU: the writer's bridge_model says why), with transformers given the same tokens, pixel patches, grid and token
types; the vision blocks over a patch sequence, the same rotary table given
to both; each patch merger (final and deepstack) on the same input; the patch embedding. Names
and shapes are those transformers' save_pretrained writes for the config; legacy and torch_dist merge to the same
bytes; the tokenizer, chat template and image processor files are those of the config folder. verl's Megatron actor
folders of the same torch_dist save (its current layout and the one before) merge to the same bytes as it.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers.in_process import merge_in_process, refused_here
from tests.helpers.legacy_copies import edited_copy
from tests.helpers.megatron_mtp_models import assert_megatron_logits, load_vlm, merged_once, oracle, text_config_folder
from tests.helpers.megatron_vlms import (assert_config_folder_files_copied, assert_image_logits_are_megatrons,
                                        assert_tower_is_megatrons, save_pretrained_shapes, write_vlm_cases)
from tests.helpers.weights import assert_same_weights, load_safetensors_folder
from tests.writers.tiny_models import build_image_processor
from tests.writers.verl_megatron_lora import DIST, HF, write_manifest

pytestmark = pytest.mark.slow

CASE, MOE_CASE, PP_CASE = "qwen3_vl_tp2", "qwen3_vl_moe_tp2_ep2", "qwen3_vl_pp2"
# PP 2 at TP 1: the writer's 2 ranks; 2 text layers a stage, as many as the tower's deepstack mergers feed (the
# bridge asks the first stage for that many)
CASES = {CASE: "tp=2", MOE_CASE: "arch=qwen3_vl_moe_text,ep=2", PP_CASE: "tp=1,pp=2,layers=4"}


@pytest.fixture(scope="session")
def vl_root(tmp_path_factory):
    return write_vlm_cases(tmp_path_factory, "megatron_qwen3_vl", CASES, "megatron_qwen3_vl.py",
                           build_image_processor())


@pytest.fixture(scope="session")
def merged(vl_root, tmp_path_factory):
    return merged_once(vl_root, tmp_path_factory)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_text_and_image_logits_are_megatrons(case, fmt, vl_root, merged):
    """The text logits are the language model's; the text+image logits Megatron-Bridge's own Qwen3VLModel's over the
    saved tensors (its tower on the pixel patches with their grid, interpolated position embeddings and 2D rotary,
    the deepstack mergers' output added into the first text layers, MRoPE positions; pipelined over the two stages
    for the PP case), against transformers' forward from the same tokens, pixels, grid and token types."""
    expected = oracle(vl_root, case)
    model = load_vlm(merged(case, fmt))
    with torch.no_grad():
        logits = model(input_ids=expected["tokens"]).logits
    assert_megatron_logits(logits, expected["logits"])
    assert_image_logits_are_megatrons(model, expected)


def test_position_embeddings_with_h_and_w_swapped_fail_the_image_check(vl_root, merged):
    """The tower's 4 x 4 table of position embeddings, which only the image's forward reads (interpolated to its 6 x 4
    patches; no module check does), transposed: the text+image check the merge passes fails."""
    expected = oracle(vl_root, CASE)
    model = load_vlm(merged(CASE, "dist"))
    table = model.model.visual.pos_embed.weight
    side = int(table.shape[0] ** 0.5)
    table.data = table.data.view(side, side, -1).transpose(0, 1).reshape(table.shape).clone()
    with pytest.raises(AssertionError):
        assert_image_logits_are_megatrons(model, expected)


@pytest.mark.parametrize("case", CASES)
def test_vision_tower_modules_compute_what_megatrons_do(case, vl_root, merged):
    """The blocks (fused qkv split per head into HF's [q; k; v], TP-split linears, LayerNorms), the final and
    deepstack patch mergers and the patch embedding, each given Megatron's inputs."""
    assert_tower_is_megatrons(load_vlm(merged(case, "dist")).model.visual, oracle(vl_root, case))


@pytest.mark.parametrize("case", CASES)
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


@pytest.mark.parametrize("case", CASES)
def test_names_and_shapes_are_those_save_pretrained_writes(case, vl_root, merged, tmp_path):
    ours = load_safetensors_folder(merged(case, "legacy"))
    assert {n: tuple(t.shape) for n, t in ours.items()} == save_pretrained_shapes(vl_root / case / "hf", tmp_path)
    assert "model.visual.deepstack_merger_list.1.linear_fc1.weight" in ours
    if case == MOE_CASE:  # the experts stacked as transformers keeps them: [E, 2F, D], [E, D, F]
        assert ours["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 48, 64)
        assert "model.language_model.layers.0.mlp.gate_proj.weight" in ours  # the dense first layer


def test_processor_and_chat_template_files_are_the_config_folders(vl_root, merged):
    assert_config_folder_files_copied(vl_root / CASE / "hf", merged(CASE, "dist"))


def test_an_mtp_layer_in_the_text_model_is_refused_in_one_line(vl_root, merged, tmp_path, capsys):
    """transformers' Qwen3-VL has no multi-token-prediction layer: one would otherwise land on decoder layer 0.
    --drop-mtp leaves it out: the merge is then the one without it, byte for byte."""
    def add_mtp(state):
        state["model"]["language_model.mtp.layers.0.enorm.weight"] = torch.ones(32)

    legacy = edited_copy(vl_root / CASE / "legacy", tmp_path / "legacy", add_mtp)
    assert refused_here(capsys, tmp_path / "out", "--local_dir", legacy, "--hf_model_config_path",
                        vl_root / CASE / "hf") == [
        f"merger: error: Megatron tensor language_model.mtp.layers.0.enorm.weight is a multi-token-prediction "
        f"layer's, which HF qwen3_vl has no place for (pass --drop-mtp to leave MTP layers out), {legacy}"]
    dropped = merge_in_process(legacy, tmp_path / "dropped", "--hf_model_config_path", vl_root / CASE / "hf",
                               "--dtype", "float32", "--drop-mtp")
    assert_same_weights(dropped, merged(CASE, "legacy"), None)


def test_a_vision_tower_split_over_pipeline_stages_is_refused_in_one_line(vl_root, tmp_path, capsys):
    """Megatron-Bridge's VLMs build the tower on the first stage alone; a tower layer in the second stage's file too
    (numbered from 0 there, as a tower pipelined by stage would be) could not be told from the first stage's."""
    def tower_layer_in_stage_1(state):
        if not any(k.startswith("vision_model.") for k in state["model"]):
            state["model"]["vision_model.decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(32, 48)

    legacy = edited_copy(vl_root / PP_CASE / "legacy", tmp_path / "legacy", tower_layer_in_stage_1)
    assert refused_here(capsys, tmp_path / "out", "--local_dir", legacy, "--hf_model_config_path",
                        vl_root / PP_CASE / "hf") == [
        f"merger: error: a Megatron vision-language checkpoint whose vision tower is split over pipeline chunks "
        f"(stage 0, chunk 0), (stage 1, chunk 0): merger reads a tower saved whole by one stage, as "
        f"Megatron-Bridge's VLMs save it (docs/megatron.md), {legacy / 'iter_0000001'}"]


def test_a_qwen3_vl_moe_text_model_without_its_tower_is_refused_in_one_line(vl_root, tmp_path, capsys):
    """transformers has no causal LM of qwen3_vl_moe_text alone: a language-model-only run stops, given the VLM's
    config.json or its text_config, rather than writing a folder nothing loads as a causal LM."""
    def text_model_alone(state):
        state["model"] = {k[len("language_model."):]: v for k, v in state["model"].items()
                          if k.startswith("language_model.")}

    legacy = edited_copy(vl_root / MOE_CASE / "legacy", tmp_path / "legacy", text_model_alone)
    for hf in (vl_root / MOE_CASE / "hf", text_config_folder(vl_root / MOE_CASE / "hf", tmp_path / "text")):
        assert refused_here(capsys, tmp_path / "out", "--local_dir", legacy, "--hf_model_config_path", hf) == [
            "merger: error: the Megatron checkpoint holds no vision tower (vision_model.*), and merger writes the "
            "qwen3_vl_moe family only as HF qwen3_vl_moe with it: transformers has no causal LM of "
            "qwen3_vl_moe_text alone, config.json"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["ckpt_contents", "before"])
def test_a_verl_megatron_actor_merges_as_its_torch_dist_save(case, layout, vl_root, merged, tmp_path):
    """verl's Megatron actor saves the model with dist_checkpointing under the names Megatron-Bridge's and mbridge's
    Qwen3VLModel both give it (language_model.*, vision_model.*): its current layout (ckpt_contents.json,
    model/dist_ckpt/, model/huggingface/) and the one before it (dist_ckpt/, huggingface/) are merged from actor/
    with no flag, the config and processor files found beside the shards, into the same bytes as the torch_dist save
    merged with its config folder (which the tests above hold to Megatron's forward)."""
    actor = tmp_path / "actor"
    model = actor / "model" if layout == "ckpt_contents" else actor
    shutil.copytree(vl_root / case / "dist" / "iter_0000001", model / "dist_ckpt")
    shutil.copytree(vl_root / case / "hf", model / "huggingface")
    if layout == "ckpt_contents":
        write_manifest(actor, {"model": DIST, "hf_config": HF}, dist=True)
    out = merge_in_process(actor, tmp_path / "out", "--dtype", "float32")
    assert_same_weights(out, merged(case, "dist"), None)
    assert_config_folder_files_copied(vl_root / case / "hf", out)
