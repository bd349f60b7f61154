"""What the tests of tests/writers/megatron_deepseek.py's checkpoints share (DeepSeek-V3 and GLM-4.5 style, with
multi-token-prediction layers): the cases written in one torchrun launch, each merged once per set of flags, the
oracle the writer saved, the merged model loaded, its MTP layer's logits as transformers computes them, and the
checks against Megatron's logits (fp32, max abs diff < 1e-4, the same argmax). The Megatron VLM tests
(test_megatron_qwen3_vl.py, test_megatron_qwen3_5_vl.py, test_megatron_glm45v.py) share them too, with the merged
VLM loaded and a config folder of a VLM's text_config."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.helpers.files import assert_same_files
from tests.helpers.in_process import merge_in_process
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.weights import load_safetensors_folder


def write_cases(tmp_path_factory, name: str, cases: dict[str, str], writer: str = "megatron_deepseek.py",
                python: str = sys.executable) -> Path:
    """The folder holding ROOT/case/{legacy,dist,hf,logits.pt} for each NAME: spec of `cases`, written by
    tests/writers/`writer` (one that writes that layout: megatron_deepseek.py, megatron_gdn.py) run by `python`
    (the writer venv's for megatron-core 0.19: tests/helpers/writers312.py)."""
    root = tmp_path_factory.mktemp(name)
    run_writer(writer, "--out", root,
               *[arg for case, spec in cases.items() for arg in ("--case", f"{case}:{spec}")], nproc=2,
               python=python)
    return root


def merged_once(root: Path, tmp_path_factory):
    """merged(case, fmt, *flags) -> fp32 HF folder merged from ROOT/case/fmt, built once."""
    cache: dict = {}

    def make(case: str, fmt: str, *flags: str) -> Path:
        if (case, fmt, flags) not in cache:
            out = tmp_path_factory.mktemp(f"{case}_{fmt}") / "hf"
            cache[(case, fmt, flags)] = merge_in_process(root / case / fmt, out, "--hf_model_config_path",
                                                         root / case / "hf", "--dtype", "float32", *flags)
        return cache[(case, fmt, flags)]

    return make


def assert_ranks_write_one_process_files(src: Path, hf: Path, out: Path, nproc: int) -> None:
    """`nproc` merge ranks merge SRC (config HF) into OUT/ranks, over at least as many files as ranks, and one process
    into OUT/one with the same flags: the same files, byte for byte."""
    flags = ("--hf_model_config_path", hf, "--dtype", "float32", "--max_shard_size", "100KB")
    run_merger("merge", "--local_dir", src, "--target_dir", out / "ranks", *flags, nproc=nproc)
    merge_in_process(src, out / "one", *flags)
    assert len(list((out / "one").glob("*.safetensors"))) >= nproc
    assert_same_files(out / "ranks", out / "one")


def oracle(root: Path, case: str) -> dict:
    return torch.load(root / case / "logits.pt", weights_only=True)


def load(folder: Path):
    """The merged model and the keys it did not load. transformers ignores MTP layers only at the real models'
    layer numbers (DeepSeek-V3's 61, GLM-4.5's 92), so a tiny model's MTP layer loads as unexpected keys: nothing
    may be missing."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"], info
    return model.eval(), set(info["unexpected_keys"])


def load_vlm(folder: Path):
    """The merged HF VLM (AutoModelForImageTextToText), every tensor loaded and none left over."""
    import transformers

    model, info = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def text_config_folder(vlm_folder: Path, dest: Path) -> Path:
    """A config folder whose config.json is the `text_config` of VLM_FOLDER's: a text model's config given for a
    VLM."""
    dest.mkdir()
    config = json.loads((vlm_folder / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config["text_config"]))
    return dest


def load_beside_mtp(folder: Path, expected: dict):
    """The merged model, checked to leave unloaded only its MTP layer, and that only where Megatron's had one."""
    model, unexpected = load(folder)
    mtp_layer = f"model.layers.{model.config.num_hidden_layers}."
    assert all(k.startswith(mtp_layer) for k in unexpected), unexpected
    assert bool(unexpected) == ("mtp_logits" in expected)
    return model


def assert_loads_with_megatron_logits(folder: Path, expected: dict) -> None:
    """The merged model loads whole, every tensor in it taken, and gives Megatron's logits."""
    model, unexpected = load(folder)
    assert not unexpected
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


def saved_by_transformers(config: Path, out: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors transformers' own save_pretrained writes into OUT for a model of the config folder CONFIG (at
    `dtype`, else the config's), by name."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config),
                                                          **({"dtype": dtype} if dtype else {}))
    model.save_pretrained(out)
    return load_safetensors_folder(out)


def assert_megatron_logits(logits: torch.Tensor, expected: torch.Tensor) -> None:
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def assert_mtp_dropped(out: Path, with_mtp: Path, expected: dict) -> None:
    """`out`, merged with --drop-mtp, is `with_mtp` without its MTP layer: config.json counts none, every tensor but
    the MTP layer's is there, the model loads whole and gives Megatron's logits."""
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    model, unexpected = load(out)
    assert not unexpected
    mtp_layer = f"model.layers.{model.config.num_hidden_layers}."
    assert sorted(load_safetensors_folder(out)) == sorted(
        k for k in load_safetensors_folder(with_mtp) if not k.startswith(mtp_layer))
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


def mtp_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The first MTP layer's logits from transformers' own MtpModel, which loads the merged `model.layers.{L}.*` as
    it loads the real models' MTP layer, fed as Megatron feeds its MTP layer: token i + 1's embedding at position
    i, and a 0 rolled in at the end."""
    from transformers.modeling_layers import MtpModel

    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(model)
    shifted = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state
        out = mtp.forward_layer(0, hidden, torch.arange(tokens.shape[1])[None], None, input_ids=shifted)
        return mtp._project_to_logits(out)


MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "final_layernorm.weight": "shared_head.norm.weight"}  # Megatron's name -> DeepSeek-V3's


def assert_mtp_layer_tensors(folder: Path, expected: dict[str, torch.Tensor], layer: int) -> None:
    """The first MTP layer's own tensors as the writer gathered them from the Megatron module (`mtp_params`) are
    the merged `model.layers.{layer}.*` under DeepSeek-V3's names; its embed_tokens and shared_head.head are the
    model's embedding and output layer."""
    weights = load_safetensors_folder(folder)
    assert sorted(expected) == sorted(f"mtp.layers.0.{n}" for n in MTP_OWN)
    for megatron, hf in MTP_OWN.items():
        assert torch.equal(weights[f"model.layers.{layer}.{hf}"], expected[f"mtp.layers.0.{megatron}"]), hf
    assert torch.equal(weights[f"model.layers.{layer}.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(weights[f"model.layers.{layer}.shared_head.head.weight"], weights["lm_head.weight"])
