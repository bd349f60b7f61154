"""torchtitan model families beyond Llama: a Qwen3-MoE DCP checkpoint as torchtitan saves it (qk-norm, GQA, MoE
layers whose routed experts are stacked [E, F, D] tensors), written by torchtitan itself on 2 gloo ranks
(tests/writers/torchtitan_checkpoint.py). Oracle: torchtitan's own forward logits of the unsharded model against
transformers' Qwen3MoeForCausalLM logits on the merged output (torchtitan's to_hf is not an oracle for every
family)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.expert_slabs import assert_stacks_written_by_expert
from tests.helpers.in_process import merge_in_process, single_error_line
from tests.helpers.processes import run_merger
from tests.helpers.torchtitan_writes import TOKENS, refused_as_kimi_k25, written_by_torchtitan
from tests.helpers.weights import load_safetensors_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def qwen3_moe_root(tmp_path_factory) -> Path:
    return written_by_torchtitan(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def qwen3_moe_merged(qwen3_moe_root, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("qwen3_moe_merged") / "out"
    proc = run_merger("merge", "--local_dir", qwen3_moe_root / "checkpoint" / "step-1", "--target_dir", out,
                      "--hf_model_config_path", qwen3_moe_root / "hf", "--dtype", "float32")
    return out, proc.stderr


def test_qwen3_moe_logits_match_torchtitan(qwen3_moe_root, qwen3_moe_merged):
    out, _ = qwen3_moe_merged
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
    titan = torch.load(qwen3_moe_root / "logits.pt", weights_only=True)
    assert (logits - titan).abs().max().item() < 1e-4


def test_qwen3_moe_experts_written_per_expert_as_transformers_saves(qwen3_moe_root, qwen3_moe_merged, tmp_path):
    """The names and shapes save_pretrained writes for this config, no tensor more or less."""
    out, log = qwen3_moe_merged
    config = transformers.AutoConfig.from_pretrained(qwen3_moe_root / "hf")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "saved")
    saved = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "saved").items()}
    assert {n: t.shape for n, t in load_safetensors_folder(out).items()} == saved
    assert "merger: torchtitan qwen3 names, written as HF qwen3_moe; 6 stacked expert tensors split per expert" in log
    assert "layers.0.moe.expert_bias_E (Qwen3-MoE routes by scores alone" in log


def test_qwen3_moe_torchrun_equals_one_process(qwen3_moe_root, qwen3_moe_merged, tmp_path):
    """3 merge ranks over a 2-rank checkpoint: every expert's slice read where it lies, the same bytes."""
    run_merger("merge", "--local_dir", qwen3_moe_root / "checkpoint" / "step-1", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", qwen3_moe_root / "hf", "--dtype", "float32", "--max_shard_size", "20KB",
               nproc=3)
    one, three = load_safetensors_folder(qwen3_moe_merged[0]), load_safetensors_folder(tmp_path / "out")
    assert one.keys() == three.keys() and all(torch.equal(one[n], three[n]) for n in one)


def test_a_config_that_ties_a_distinct_output_keeps_it(qwen3_moe_root, tmp_path):
    """torchtitan's `output` (lm_head) under a config edited to tie the embeddings, merged on 2 ranks: still
    written, the output's config unties, and the model gives torchtitan's logits."""
    hf = tmp_path / "hf"
    shutil.copytree(qwen3_moe_root / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    (hf / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    proc = run_merger("merge", "--local_dir", qwen3_moe_root / "checkpoint" / "step-1", "--target_dir",
                      tmp_path / "out", "--hf_model_config_path", hf, "--dtype", "float32", "--verify", nproc=2)
    assert "both are written, and the output's config.json says tie_word_embeddings: false" in proc.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings is False
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
    assert (logits - torch.load(qwen3_moe_root / "logits.pt", weights_only=True)).abs().max().item() < 1e-4


def test_torchtitan_names_with_another_model_config_are_refused(qwen3_moe_root, tmp_path):
    config = json.loads((qwen3_moe_root / "hf" / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    proc = run_merger("merge", "--local_dir", qwen3_moe_root / "checkpoint" / "step-1", "--target_dir",
                      tmp_path / "out", "--hf_model_config_path", tmp_path / "hf", check=False)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert single_error_line(proc.stderr) == (
        f"merger: error: torchtitan qwen3 names, but config.json has model_type 'llama' (expected qwen3 or "
        f"qwen3_moe): pass the HF config of this model with --hf_model_config_path, {tmp_path / 'hf' / 'config.json'}")


def test_model_flag_forces_a_family_and_names_a_stray_tensor(qwen3_moe_root, tmp_path):
    """--model torchtitan-llama on Qwen3 names: the first tensor its table lacks is named."""
    proc = run_merger("merge", "--local_dir", qwen3_moe_root / "checkpoint" / "step-1", "--target_dir",
                      tmp_path / "out", "--hf_model_config_path", qwen3_moe_root / "hf", "--model", "torchtitan-llama",
                      check=False)
    error = single_error_line(proc.stderr)
    assert proc.returncode == 1 and "has no HF name in torchtitan's llama table" in error, error


def test_deepseek_v3_logits_match_torchtitan(deepseek_v3_root, tmp_path):
    """MLA with q-LoRA, a dense first layer, a sigmoid router whose routing bias changes the choice
    (e_score_correction_bias), a shared expert; merged on 3 ranks. transformers' DeepseekV3 gives torchtitan's
    logits, and loads every tensor save_pretrained would write."""
    run_merger("merge", "--local_dir", deepseek_v3_root / "checkpoint" / "step-1", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", deepseek_v3_root / "hf", "--dtype", "float32", nproc=3)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits
    titan = torch.load(deepseek_v3_root / "logits.pt", weights_only=True)
    assert (logits - titan).abs().max().item() < 1e-4


@pytest.fixture(scope="session")
def deepseek_v3_mtp_root(tmp_path_factory) -> Path:
    return written_by_torchtitan(tmp_path_factory, "deepseek_v3", "--mtp", "1")


def test_deepseek_v3_mtp_layer_reproduces_torchtitan_mtp_logits(deepseek_v3_mtp_root, tmp_path):
    """torchtitan's MTP block becomes HF layer L (enorm, hnorm, eh_proj, shared_head, its own embed_tokens):
    transformers' MtpModel loading it predicts the token after next as torchtitan's MTP layer does, and the main
    logits are torchtitan's too."""
    from transformers.modeling_layers import MtpModel

    merge_in_process(deepseek_v3_mtp_root / "checkpoint" / "step-1", tmp_path / "out",
                     "--hf_model_config_path", deepseek_v3_mtp_root / "hf", "--dtype", "float32")
    main, mtp_logits = torch.load(deepseek_v3_mtp_root / "logits.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    assert model.config.num_nextn_predict_layers == 1
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers}\..*"]  # where MtpModel looks
    mtp = MtpModel.from_pretrained(model)
    tokens = torch.tensor(TOKENS)
    shifted = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)  # torchtitan rolls a 0 in
    # torchtitan's MTP block reads the last decoder layer's output before the final norm: the norm's input.
    before_norm = []
    model.model.norm.register_forward_hook(lambda module, args, out: before_norm.append(args[0]))
    with torch.no_grad():
        assert (model(tokens).logits - main).abs().max().item() < 1e-4
        out = mtp.forward_layer(0, before_norm[0], torch.arange(tokens.shape[1])[None], None, input_ids=shifted)
        # The last position's next token is the rolled-in 0, which torchtitan masks as invalid; one layer more
        # than the main path, in another attention kernel (flex vs sdpa): within 1e-3 (a wrong norm is ~0.1 off).
        assert (mtp._project_to_logits(out) - mtp_logits)[:, :-1].abs().max().item() < 1e-3


def test_deepseek_v3_drop_mtp_loads_with_no_stray_key(deepseek_v3_mtp_root, tmp_path):
    merge_in_process(deepseek_v3_mtp_root / "checkpoint" / "step-1", tmp_path / "out",
                     "--hf_model_config_path", deepseek_v3_mtp_root / "hf", "--drop-mtp")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.num_nextn_predict_layers == 0


def test_mtp_layers_with_a_vlm_config_are_refused(deepseek_v3_mtp_root, tmp_path):
    """MTP layers are numbered and counted in the text model's config.json: with transformers' kimi_k25 (the VLM)
    as config.json they are refused, not written where the VLM's loader would not look, and nothing is written."""
    assert refused_as_kimi_k25(deepseek_v3_mtp_root, tmp_path) == (
        f"merger: error: the torchtitan checkpoint holds multi-token-prediction layers, which are written with the "
        f"text model's config.json, not HF kimi_k25's (pass --drop-mtp to leave them out, or this config's "
        f"text_config with --hf_model_config_path), {tmp_path / 'hf' / 'config.json'}")


def test_qwen3_dense_logits_match_torchtitan(tmp_path_factory, tmp_path):
    root = written_by_torchtitan(tmp_path_factory, "qwen3")
    merge_in_process(root / "checkpoint" / "step-1", tmp_path / "out", "--hf_model_config_path", root / "hf",
                     "--dtype", "float32")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits
    assert (logits - torch.load(root / "logits.pt", weights_only=True)).abs().max().item() < 1e-4


def test_gpt_oss_fused_experts_give_torchtitan_logits(tmp_path_factory, tmp_path):
    """gpt-oss: attention with biases and sinks, a router with a bias, and experts transformers keeps fused on
    disk (gate_up_proj [E, D, 2F], interleaved). torchtitan's model runs in bf16 here (its experts multiply in
    bf16), so the bound is bf16's: within 2% of the largest logit (0.75% on this seed, deterministic on CPU);
    gate and up de-interleaved is 3.5% off, a wrong transpose does not load."""
    root = written_by_torchtitan(tmp_path_factory, "gpt_oss")
    run_merger("merge", "--local_dir", root / "checkpoint" / "step-1", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", root / "hf", "--dtype", "bfloat16", nproc=2)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "GptOssForCausalLM" and not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits.float()
    titan = torch.load(root / "logits.pt", weights_only=True).float()
    assert (logits - titan).abs().max().item() < 0.02 * titan.abs().max().item()


def test_gpt_oss_stacked_experts_are_written_an_expert_at_a_time(tmp_path_factory, tmp_path):
    """torchtitan keeps gpt-oss's experts stacked [E, ...] as HF does: each is read and written an expert's slab at
    a time, so no rank holds a whole stack; two merge ranks, several files, write what one process does."""
    root = written_by_torchtitan(tmp_path_factory, "gpt_oss")
    src = root / "checkpoint" / "step-1"
    assert_stacks_written_by_expert(src, root / "hf")
    for nproc in (1, 2):
        run_merger("merge", "--local_dir", src, "--target_dir", tmp_path / f"x{nproc}", "--hf_model_config_path",
                   root / "hf", "--max_shard_size", "100KB", nproc=nproc)
    assert len(list((tmp_path / "x1").glob("*.safetensors"))) > 1
    assert all(f.read_bytes() == (tmp_path / "x2" / f.name).read_bytes() for f in (tmp_path / "x1").iterdir()
               if f.suffix == ".safetensors")
