"""Megatron checkpoints (legacy and torch_dist) merged to HF, checked against Megatron's own forward pass.

megatron-core writes every checkpoint (tests/writers/megatron_checkpoint.py, one torchrun launch of 4 gloo
ranks for all cases). The oracle is Megatron's CPU forward logits on the same tokens: the merged HF model
must reproduce them (fp32, max abs diff < 1e-4). Legacy and torch_dist saves of one model must merge to the
same tensors, bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.enums_by_name import repickle
from tests.helpers.files import flip_bit_in_tensor, metadata_naming
from tests.helpers.in_process import merge_in_process as merge
from tests.helpers.in_process import single_error_line
from tests.helpers.logits import hf_logits
from tests.helpers.megatron_cases import CASES
from tests.helpers.processes import run_merger, run_merger_leaving_no_thread
from tests.helpers.weights import assert_same_weights

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

MODELS = [c for c in CASES if c != "optim_only"]


@pytest.fixture(scope="session")
def merged(megatron_root, tmp_path_factory):
    """merged(case, fmt) -> fp32 HF folder merged from ROOT/case/fmt (a Megatron-LM save dir), built once."""
    cache: dict = {}

    def make(case: str, fmt: str) -> Path:
        if (case, fmt) not in cache:
            out = tmp_path_factory.mktemp(f"{case}_{fmt}") / "hf"
            value = ["--is_value_model"] if is_critic(case) else []
            cache[(case, fmt)] = merge(megatron_root / case / fmt, out, "--hf_model_config_path",
                                       megatron_root / case / "hf", "--dtype", "float32", *value)
        return cache[(case, fmt)]

    return make


def is_critic(case: str) -> bool:
    return "value=1" in CASES[case]


@pytest.mark.parametrize("case", MODELS)
def test_legacy_merge_reproduces_megatron_logits(case, megatron_root, merged):
    oracle = torch.load(megatron_root / case / "logits.pt", weights_only=True)
    logits = hf_logits(merged(case, "legacy"), oracle["tokens"], is_critic(case))
    assert logits.shape == oracle["logits"].shape
    assert (logits - oracle["logits"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", MODELS)
def test_torch_dist_merge_equals_legacy_merge(case, merged):
    assert_same_weights(merged(case, "dist"), merged(case, "legacy"), None)


def test_tied_output_layer_is_dropped_and_vocab_unpadded(merged):
    from tests.helpers.weights import load_safetensors_folder

    weights = load_safetensors_folder(merged("tp2_pp2_vpp2_tied", "legacy"))
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape[0] == 101


def test_a_config_that_ties_a_distinct_output_layer_keeps_it(megatron_root, tmp_path):
    """An untied model's config edited to tie the embeddings: output_layer, trained apart from the embedding, is
    still written as lm_head (vocab unpadded, over 2 TP ranks), the output's config unties, and the merged model
    reproduces Megatron's logits."""
    case = "tp2_gqa_bias"
    hf = tmp_path / "hf"
    shutil.copytree(megatron_root / case / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    (hf / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = merge(megatron_root / case / "legacy", tmp_path / "out", "--hf_model_config_path", hf, "--dtype", "float32")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    oracle = torch.load(megatron_root / case / "logits.pt", weights_only=True)
    assert (hf_logits(out, oracle["tokens"], False) - oracle["logits"]).abs().max().item() < 1e-4


def test_critic_becomes_token_classification(merged):
    import transformers

    config = transformers.AutoConfig.from_pretrained(merged("critic_tp2", "legacy"))
    assert config.architectures == ["Qwen2ForTokenClassification"]
    assert config.num_labels == 1


def test_moe_experts_are_numbered_globally(merged):
    from tests.helpers.weights import load_safetensors_folder

    names = load_safetensors_folder(merged("moe_tp2_ep2", "legacy"))
    for layer in range(2):
        for expert in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight" in names
        assert f"model.layers.{layer}.mlp.shared_expert_gate.weight" in names


def test_torchrun_merge_equals_single_process(megatron_root, merged, tmp_path):
    """Two merge ranks split the 4 rank files: the TP halves of a QKV or gate/up weight that one rank writes
    cross ranks, every byte sent is received; no rank leaves a thread behind when it is done."""
    case, fmt = "moe_tp2_ep2", "legacy"
    run_merger_leaving_no_thread("merge", "--local_dir", megatron_root / case / fmt, "--target_dir",
                                 tmp_path / "out", "--hf_model_config_path", megatron_root / case / "hf",
                                 "--dtype", "float32", "--summary_json", tmp_path / "summary.json", nproc=2)
    assert_same_weights(tmp_path / "out", merged(case, fmt), None)
    moved = json.loads((tmp_path / "summary.json").read_text())["bytes_per_rank"]
    assert sum(m["sent_bytes"] for m in moved) == sum(m["received_bytes"] for m in moved) > 0


@pytest.mark.parametrize("layout", ["actor", "actor/model"])
def test_verl_layout_finds_dist_ckpt_and_huggingface(layout, megatron_root, merged, tmp_path):
    """verl: `actor/{huggingface,dist_ckpt}` (older) or `actor/model/{...}` (newer); config from huggingface/."""
    case = "tp2_gqa_bias"
    base = tmp_path / layout
    shutil.copytree(megatron_root / case / "dist" / "iter_0000001", base / "dist_ckpt")
    shutil.copytree(megatron_root / case / "hf", base / "huggingface")
    out = merge(tmp_path / "actor", tmp_path / "out", "--dtype", "float32")
    assert_same_weights(out, merged(case, "legacy"), None)


def test_verl_hf_safetensors_beside_an_empty_dist_ckpt(megatron_root, merged, tmp_path):
    """verl's newer default: weights as HF safetensors in huggingface/, dist_ckpt/ without model tensors."""
    import transformers

    actor = tmp_path / "actor"
    shutil.copytree(megatron_root / "optim_only" / "dist" / "iter_0000001", actor / "dist_ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(merged("tp2_gqa_bias", "legacy"), dtype=torch.float32)
    model.save_pretrained(actor / "huggingface", max_shard_size="40KB")  # several files, as large models are
    out = merge(actor, tmp_path / "out", "--dtype", "bfloat16")
    assert_same_weights(out, actor / "huggingface", torch.bfloat16)
    sources = json.loads((out / "merge_manifest.json").read_text())["source_files"]
    assert sources and all(Path(f).parent.name == "huggingface" for f in sources)  # read from there


@pytest.mark.parametrize("given", ["save dir", "iteration folder"])
def test_megatron_lm_save_dir_with_huggingface_beside_the_iterations(given, megatron_root, merged, tmp_path):
    """A Megatron-LM save dir (tracker file, iter_*/) holding the HF config as huggingface/: found without
    --hf_model_config_path, whether the save dir or its iteration folder is given."""
    case = "tp2_gqa_bias"
    save = Path(shutil.copytree(megatron_root / case / "legacy", tmp_path / "save"))
    shutil.copytree(megatron_root / case / "hf", save / "huggingface")
    out = merge(save if given == "save dir" else save / "iter_0000001", tmp_path / "out", "--dtype", "float32")
    assert_same_weights(out, merged(case, "legacy"), None)
    assert (out / "tokenizer.json").is_file() == (save / "huggingface" / "tokenizer.json").is_file()


def test_torch_dist_metadata_with_enums_by_name(megatron_root, merged, tmp_path):
    """The .metadata as Python 3.11.0-3.11.4 write it (enum members as getattr(EnumClass, NAME)) merges alike."""
    case = "tp2_gqa_bias"
    src = Path(shutil.copytree(megatron_root / case / "dist", tmp_path / "dist"))
    repickle(src / "iter_0000001" / ".metadata")
    out = merge(src, tmp_path / "out", "--hf_model_config_path", megatron_root / case / "hf", "--dtype", "float32")
    assert_same_weights(out, merged(case, "legacy"), None)


def test_iteration_folder_and_default_bf16(megatron_root, merged, tmp_path):
    case = "qwen3_mqa_pp2"
    out = merge(megatron_root / case / "legacy" / "iter_0000001", tmp_path / "out",
                "--hf_model_config_path", megatron_root / case / "hf")
    assert_same_weights(out, merged(case, "legacy"), torch.bfloat16)


def test_missing_rank_file_is_reported(megatron_root, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(megatron_root / "tp2_gqa_bias" / "legacy", src)
    shutil.rmtree(src / "iter_0000001" / "mp_rank_01")
    proc = run_merger("merge", "--local_dir", src, "--target_dir", tmp_path / "out", "--hf_model_config_path",
                      megatron_root / "tp2_gqa_bias" / "hf", check=False)
    assert proc.returncode == os.EX_NOINPUT
    assert "merger: error: rank file for tp 1 pp 0 ep 0 is missing" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_flipped_bit_in_a_rank_file_fails_its_checksum(megatron_root, tmp_path):
    """A bit flipped in a gated fc1 (read as two pieces, its gate and up halves) fails the record's CRC-32."""
    src = tmp_path / "ckpt"
    shutil.copytree(megatron_root / "tp2_gqa_bias" / "legacy", src)
    victim = src / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    flip_bit_in_tensor(victim, torch.load(victim, weights_only=False)["model"][name])  # our own test file
    proc = run_merger("merge", "--local_dir", src, "--target_dir", tmp_path / "out", "--hf_model_config_path",
                      megatron_root / "tp2_gqa_bias" / "hf", check=False)
    assert proc.returncode == os.EX_DATAERR
    error = single_error_line(proc.stderr)
    assert "checksum mismatch in tensor" in error and name in error and error.endswith(str(victim)), error
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()


def test_unknown_family_is_reported(megatron_root, tmp_path, capsys):
    from merger.cli import main

    hf = tmp_path / "hf"
    shutil.copytree(megatron_root / "tp2_gqa_bias" / "hf", hf)
    config = (hf / "config.json").read_text().replace('"model_type": "qwen2"', '"model_type": "gpt2"')
    (hf / "config.json").write_text(config)
    assert main(["merge", "--local_dir", str(megatron_root / "tp2_gqa_bias" / "dist"), "--target_dir",
                 str(tmp_path / "out"), "--hf_model_config_path", str(hf)]) == 1
    assert "no Megatron mapping for model_type 'gpt2'" in capsys.readouterr().err


@pytest.mark.parametrize("model_type, reason", [("step3p7", "head-wise attention gate is not in megatron-core"),
                                                ("gemma4_text", "norms after attention and MLP"),
                                                ("deepseek_v4", "hyper-connections")])
def test_family_megatron_core_cannot_build_says_why(megatron_root, tmp_path, capsys, model_type, reason):
    """Step-3.7, Gemma 4 and DeepSeek-V4 need modules megatron-core 0.19.2 lacks, so merger has no layout of theirs to
    read: the line says which, rather than only 'no Megatron mapping' and a list of every model type merger knows."""
    from merger.cli import main

    hf = tmp_path / "hf"
    shutil.copytree(megatron_root / "tp2_gqa_bias" / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    assert main(["merge", "--local_dir", str(megatron_root / "tp2_gqa_bias" / "dist"), "--target_dir",
                 str(tmp_path / "out"), "--hf_model_config_path", str(hf)]) == 1
    error = single_error_line(capsys.readouterr().err)
    assert f"no Megatron mapping for model_type {model_type!r}: " in error and "megatron-core 0.19.2" in error, error
    assert reason in error and "(known:" not in error and error.endswith("config.json"), error
    assert not (tmp_path / "out").exists()


def _as_vlm(state: dict) -> dict:
    """A language model's tensors as a Megatron VLM holds them (mbridge / Megatron-Bridge: `language_model.`),
    beside a vision tower's tensor."""
    return {**{f"language_model.{k}": v for k, v in state.items()}, "vision_model.patch_embed.proj.weight":
            torch.zeros(8, 12)}


def _vlm_legacy(megatron_root, case: str, into) -> None:
    shutil.copytree(megatron_root / case / "legacy", into)
    for rank_file in into.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(rank_file, weights_only=False)  # our own test file
        state["model"] = _as_vlm(state["model"])
        torch.save(state, rank_file)


def test_a_vision_language_checkpoint_with_a_text_models_config_is_refused_in_one_line(megatron_root, tmp_path):
    """A Megatron VLM (legacy rank files, or a torch_dist save made by torch's own DCP writer) whose config.json is
    no HF VLM merger writes from Megatron (qwen2's here) stops with one line saying what it is, in place of its
    first tensor without an HF name, and writes nothing."""
    import torch.distributed.checkpoint as dcp

    legacy = tmp_path / "legacy"
    _vlm_legacy(megatron_root, "tp2_gqa_bias", legacy)
    dist = tmp_path / "dist"
    dcp.save(_as_vlm({"decoder.final_layernorm.weight": torch.ones(8)}), checkpoint_id=str(dist), no_dist=True)
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    for src in (legacy, dist):
        proc = run_merger("merge", "--local_dir", src, "--target_dir", tmp_path / f"out_{src.name}",
                          "--hf_model_config_path", megatron_root / "tp2_gqa_bias" / "hf", check=False)
        assert proc.returncode == 1
        assert single_error_line(proc.stderr) == (
            "merger: error: a Megatron vision-language checkpoint (language_model.* tensors and a vision tower's) "
            "with config.json model_type 'qwen2': merger writes Megatron VLMs as qwen3_vl, glm4v_moe, qwen3_5, "
            "qwen3_5_moe, qwen3_vl_moe "
            f"(docs/megatron.md; --hf_model_config_path gives the HF VLM's config), {src}")
        assert not (tmp_path / f"out_{src.name}").exists()


class _RunsCode:
    """A pickle that would run a shell command when loaded by plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_hostile_dcp_metadata_is_refused_not_run(megatron_root, tmp_path, capsys):
    import pickle

    from merger.cli import main

    src = tmp_path / "iter"
    shutil.copytree(megatron_root / "tp2_gqa_bias" / "dist" / "iter_0000001", src)
    marker = tmp_path / "ran"
    (src / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert main(["merge", "--local_dir", str(src), "--target_dir", str(tmp_path / "out"),
                 "--hf_model_config_path", str(megatron_root / "tp2_gqa_bias" / "hf")]) == os.EX_DATAERR
    assert not marker.exists()
    assert "refusing to load global" in capsys.readouterr().err


def test_chunk_file_outside_the_checkpoint_is_refused(megatron_root, tmp_path, capsys):
    """torch_dist's `.metadata` names each chunk's file: one leading out of the folder stops the merge at once."""
    from merger.cli import main

    src = Path(shutil.copytree(megatron_root / "tp2_gqa_bias" / "dist" / "iter_0000001", tmp_path / "iter"))
    victim = sorted(src.glob("*.distcp"))[-1]
    victim.rename(tmp_path / "outside.distcp")
    metadata_naming(src, victim.name, "../outside.distcp")
    assert main(["merge", "--local_dir", str(src), "--target_dir", str(tmp_path / "out"),
                 "--hf_model_config_path", str(megatron_root / "tp2_gqa_bias" / "hf")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1 and "names '../outside.distcp', which lies outside the checkpoint folder" in errors[0]
    assert errors[0].endswith(str(src / ".metadata")) and not (tmp_path / "out").exists()
