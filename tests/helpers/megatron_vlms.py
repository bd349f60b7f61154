"""What the Megatron VLM tests (test_megatron_qwen3_vl.py, test_megatron_qwen3_5_vl.py, test_megatron_glm45v.py)
share: their cases written by the writer venv with an image processor added to each config folder, the names and
shapes transformers' save_pretrained writes for a config, the config folder's files beside the merged weights, and
the check of a merged Qwen vision tower against tests/writers/megatron_qwen3_vl.py's oracle (HF's modules, with
transformers' own forward, given the inputs Megatron's were given)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.megatron_mtp_models import assert_megatron_logits, write_cases
from tests.helpers.weights import load_safetensors_folder
from tests.helpers.writers312 import writers312_python


def write_vlm_cases(tmp_path_factory, name: str, cases: dict[str, str], writer: str, processor) -> Path:
    """ROOT/case/... as `writer` writes each case from the writer venv, `processor` saved into each hf/ (the writer
    venv has no torchvision / PIL)."""
    root = write_cases(tmp_path_factory, name, cases, writer=writer, python=writers312_python())
    for case in cases:
        processor.save_pretrained(root / case / "hf")
    return root


def save_pretrained_shapes(config_folder: Path, tmp_path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape as transformers' save_pretrained writes the VLM of CONFIG_FOLDER's config."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_folder)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "own")
    return {n: tuple(t.shape) for n, t in load_safetensors_folder(tmp_path / "own").items()}


def assert_config_folder_files_copied(given: Path, out: Path) -> None:
    """The processor, chat template and tokenizer files beside the merged weights are the config folder's."""
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (given / name).read_bytes(), name


def assert_close(ours: torch.Tensor, megatron: torch.Tensor) -> None:
    assert ours.shape == megatron.shape
    assert (ours - megatron).abs().max().item() < 1e-4


def assert_image_logits_are_megatrons(model, expected: dict) -> None:
    """transformers' forward of the merged VLM `model` from the oracle's text and image (tokens, pixel patches, their
    grid, token types; the positions its own) gives the logits Megatron's forward gave on them (fp32, max abs diff
    < 1e-4, the same argmax): megatron_qwen3_vl.py's image_inputs and image_logits, megatron_glm45v.py's oracle."""
    with torch.no_grad():
        logits = model(input_ids=expected["image_tokens"], pixel_values=expected["image_pixels"],
                       image_grid_thw=expected["image_grid"], mm_token_type_ids=expected["image_token_types"]).logits
    assert_megatron_logits(logits, expected["image_logits"])


def assert_tower_is_megatrons(visual, expected: dict) -> None:
    """The blocks (fused qkv split per head into HF's [q; k; v], TP-split linears, LayerNorms) over Megatron's patch
    sequence with its rotary table, the final and any deepstack patch mergers and the patch embedding, each on its
    own input, compute what Megatron's modules did (fp32, max abs diff < 1e-4)."""
    hidden, freqs = expected["hidden"], expected["freqs"]
    cu_seqlens = torch.tensor([0, hidden.shape[0]], dtype=torch.int32)
    with torch.no_grad():
        for block in visual.blocks:
            hidden = block(hidden, cu_seqlens=cu_seqlens, position_embeddings=(freqs.cos(), freqs.sin()))
        assert_close(hidden, expected["blocks"])
        mergers = (visual.merger, *getattr(visual, "deepstack_merger_list", ()))
        for merger, out in zip(mergers, expected["mergers"], strict=True):
            assert_close(merger(expected["hidden"]), out)
        assert_close(visual.patch_embed(expected["pixels"]), expected["embedded"])
