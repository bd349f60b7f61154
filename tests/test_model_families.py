"""The model families users bring, each from a real FSDP2 checkpoint (2 gloo ranks, fully_shard + torch.save):
a verl critic (token classification, one label), a reward model (sequence classification), a vision-language
model (Qwen2-VL) with its processor files, and a remote-code model.

Oracles: the model's own save_pretrained output (names and bytes), transformers loading the output with the
right Auto class and no missing or unexpected keys, and logits identical to the original seeded model's.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import torch
import transformers

from merger import cli
import pytest

from tests.helpers.weights import assert_same_weights
from tests.writers.tiny_models import VISION_TOKENS, build_model

pytestmark = pytest.mark.slow


def merge(capsys, actor, target, *flags) -> tuple[int, str]:
    """`merger merge` in this process, float32 so logits can be compared exactly; (exit code, stderr)."""
    capsys.readouterr()
    code = cli.main(["merge", "--local_dir", str(actor), "--target_dir", str(target), "--dtype", "float32",
                     "--verify", *map(str, flags)])
    return code, capsys.readouterr().err


def loaded(auto_class, folder, **kwargs):
    model, info = auto_class.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # from_pretrained may leave weights in the mapped file, at any 8-byte offset; CPU kernels choose their
    # vector path by alignment, so bit-identical logits need the weights in fresh allocations like the original's.
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model.eval()


TOKENS = torch.tensor([[3, 7, 11, 2, 5, 9]])


def test_value_model(fsdp_checkpoint, tmp_path, capsys):
    actor, reference = fsdp_checkpoint("llama", world=2, extra=("--head", "token-cls"))
    code, err = merge(capsys, actor, tmp_path / "plain")
    assert code == 1 and "pass --is-value-model" in err and not (tmp_path / "plain").exists()

    out = tmp_path / "critic"
    assert merge(capsys, actor, out, "--is_value_model")[0] == 0  # verl's spelling
    assert_same_weights(out, reference, None)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1
    model = loaded(transformers.AutoModelForTokenClassification, out)
    assert type(model).__name__ == "LlamaForTokenClassification" and model.score.weight.shape == (1, 32)
    original = build_model("llama", head="token-cls")
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, original(TOKENS).logits)


def test_reward_model(fsdp_checkpoint, tmp_path, capsys):
    actor, reference = fsdp_checkpoint("qwen2", world=2, extra=("--head", "seq-cls"))
    out = tmp_path / "reward"
    assert merge(capsys, actor, out)[0] == 0
    assert_same_weights(out, reference, None)
    model = loaded(transformers.AutoModelForSequenceClassification, out)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    original = build_model("qwen2", head="seq-cls")
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, original(TOKENS).logits)


def test_vision_language_model(fsdp_checkpoint, tmp_path, capsys):
    actor, reference = fsdp_checkpoint("qwen2_vl", world=2)
    out = tmp_path / "vlm"
    assert merge(capsys, actor, out)[0] == 0
    # save_pretrained's own names (visual.*, model.layers.*), not the module names the checkpoint holds
    assert_same_weights(out, reference, None)
    assert (out / "preprocessor_config.json").is_file()
    model = loaded(transformers.AutoModelForImageTextToText, out)

    image_processor = transformers.AutoImageProcessor.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    image = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    vision = image_processor(images=[image], return_tensors="pt")
    n_image_tokens = int(vision["image_grid_thw"].prod()) // image_processor.merge_size ** 2
    start, end, pad = VISION_TOKENS[0], VISION_TOKENS[1], VISION_TOKENS[2]
    text = " ".join([start] + [pad] * n_image_tokens + [end, "the", "model", "reads"])
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) == n_image_tokens
    mm_types = (ids == model.config.image_token_id).long()  # what Qwen2VLProcessor returns: 1 marks image tokens
    original = build_model("qwen2_vl")
    with torch.no_grad():
        ours = model(input_ids=ids, mm_token_type_ids=mm_types, **vision).logits
        want = original(input_ids=ids, mm_token_type_ids=mm_types, **vision).logits
    assert torch.equal(ours, want)


def test_remote_code_model(fsdp_checkpoint, tmp_path, capsys):
    actor, reference = fsdp_checkpoint("remote", world=2)
    out = tmp_path / "remote"
    assert merge(capsys, actor, out, "--trust-remote-code")[0] == 0
    assert_same_weights(out, reference, None)
    assert (out / "modeling_tiny_remote.py").is_file()
    assert "AutoModelForCausalLM" in json.loads((out / "config.json").read_text())["auto_map"]
    model = loaded(transformers.AutoModelForCausalLM, out, trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForCausalLM"
    original = build_model("remote")
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, original(TOKENS).logits)

    # A config folder whose auto_map names code it lacks is refused before anything is written.
    bare = tmp_path / "bare_config"
    shutil.copytree(actor / "huggingface", bare)
    (bare / "modeling_tiny_remote.py").unlink()
    code, err = merge(capsys, actor, tmp_path / "nothing", "--hf_model_config_path", bare)
    assert code == 1 and "modeling_tiny_remote.py is not in the config folder" in err
    assert not (tmp_path / "nothing").exists()


def test_value_model_flag_needs_a_value_head(fsdp_checkpoint, tmp_path, capsys):
    actor, _ = fsdp_checkpoint("remote", world=2)  # any causal LM: an actor, not a critic
    code, err = merge(capsys, actor, tmp_path / "out", "--is-value-model")
    assert code == 1 and "needs a value head score.weight" in err
