"""torchtitan 0.3.0's qwen3_5 and kimi_k2_7 models, as DCP checkpoints torchtitan itself writes on 2 gloo ranks
(tests/writers/torchtitan_checkpoint.py), merged into HF's VLM or the text model it wraps.

- Qwen3.5 dense and MoE: a Gated DeltaNet layer (separate q, k, v projections and conv channels, which HF fuses
  into in_proj_qkv and conv1d) and a gated full-attention layer; MoE with a gated shared expert. Its vision
  tower, which torchtitan always builds, is written too where config.json is the VLM's (qwen3_5, qwen3_5_moe),
  and left out, said so, where it is the text model's.
- Kimi-K2.5 / K2.7: DeepSeek-V3 with a MoonViT vision tower, written whole where config.json is transformers'
  kimi_k25 (the VLM), as HF deepseek_v3 with the tower left out where it is the text model's.

Oracle: torchtitan's own forward logits of the unsharded model (and its vision tower's features) against
transformers' forward of the merged folder, and the names and shapes save_pretrained writes for the same config;
for kimi_k25, whose save_pretrained in transformers 5.24 writes names of its own (docs/dcp.md), torchtitan's own
to_hf: the names of Moonshot's release, which transformers converts on load.
The torchtitan Gated DeltaNet runs through FLA's pure-torch reference of its kernel (the writer's
gated_deltanet_on_cpu).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.in_process import run_in_process
from tests.helpers.processes import run_merger
from tests.helpers.skips import need_fla
from tests.helpers.torchtitan_writes import TOKENS, refused_as_kimi_k25, written_by_torchtitan
from tests.helpers.weights import load_safetensors_folder

pytestmark = pytest.mark.slow

VLM = transformers.AutoModelForImageTextToText  # qwen3_5's and qwen3_5_moe's Auto class


def _vlm_outputs(tmp_path_factory) -> tuple[Path, tuple]:
    """VLM and the writer's flags filling it: VLM/hf, the HF VLM config of the same model, and VLM/vision.pt,
    torchtitan's vision tower on seeded patches."""
    need_fla()
    vlm = tmp_path_factory.mktemp("qwen3_5_vlm")
    return vlm, ("--hf-vlm", vlm / "hf", "--vision", vlm / "vision.pt")


@pytest.fixture(scope="session")
def qwen3_5_written(tmp_path_factory) -> tuple[Path, Path]:
    vlm, flags = _vlm_outputs(tmp_path_factory)
    return written_by_torchtitan(tmp_path_factory, "qwen3_5_text", *flags), vlm


@pytest.fixture(scope="session")
def qwen3_5_root(qwen3_5_written) -> Path:
    return qwen3_5_written[0]


@pytest.fixture(scope="session")
def qwen3_5_moe_written(tmp_path_factory) -> tuple[Path, Path]:
    vlm, flags = _vlm_outputs(tmp_path_factory)
    return written_by_torchtitan(tmp_path_factory, "qwen3_5_moe_text", *flags), vlm


def _merge_args(root: Path, out: Path, *extra, hf: Path | None = None) -> list:
    return ["merge", "--local_dir", root / "checkpoint" / "step-1", "--target_dir", out,
            "--hf_model_config_path", hf or root / "hf", "--dtype", "float32", *extra]


def _merge(root: Path, out: Path, *extra, hf: Path | None = None, nproc: int = 1):
    return run_merger(*_merge_args(root, out, *extra, hf=hf), nproc=nproc)


def _merge_here(root: Path, out: Path, *extra, hf: Path | None = None) -> None:
    """_merge's one-process merge, in this process: for a test that reads only the merged folder."""
    run_in_process(*_merge_args(root, out, *extra, hf=hf))


def _loaded(out: Path, cls: str, auto=transformers.AutoModelForCausalLM):
    """The merged model, which loads with no key missing or unexpected."""
    model, info = auto.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == cls and not any(info.values()), info
    return model.eval()


def _logits(out: Path, cls: str, auto=transformers.AutoModelForCausalLM) -> torch.Tensor:
    """transformers' logits on TOKENS from the merged folder."""
    with torch.no_grad():
        return _loaded(out, cls, auto)(torch.tensor(TOKENS)).logits


def _as_save_pretrained_writes(out: Path, hf: Path, saved: Path, auto=transformers.AutoModelForCausalLM) -> None:
    config = transformers.AutoConfig.from_pretrained(hf)
    auto.from_config(config).save_pretrained(saved)
    expected = {n: t.shape for n, t in load_safetensors_folder(saved).items()}
    assert {n: t.shape for n, t in load_safetensors_folder(out).items()} == expected


def test_qwen3_5_gated_deltanet_gives_torchtitan_logits(qwen3_5_root, tmp_path):
    proc = _merge(qwen3_5_root, tmp_path / "out")
    logits = _logits(tmp_path / "out", "Qwen3_5ForCausalLM")
    titan = torch.load(qwen3_5_root / "logits.pt", weights_only=True)
    assert (logits - titan).abs().max().item() < 1e-4
    _as_save_pretrained_writes(tmp_path / "out", qwen3_5_root / "hf", tmp_path / "saved")
    assert ("merger: torchtitan qwen3_5 names, written as HF qwen3_5_text; left out: vision_encoder.* (25 tensors: "
            "the vision tower, which the HF text model has no place for)") in proc.stderr


def test_qwen3_5_torchrun_equals_one_process(qwen3_5_root, tmp_path):
    """3 merge ranks over a 2-rank checkpoint, small files: each join reads its parts where they lie, the same
    bytes."""
    _merge_here(qwen3_5_root, tmp_path / "one")
    _merge(qwen3_5_root, tmp_path / "three", "--max_shard_size", "20KB", nproc=3)
    one, three = load_safetensors_folder(tmp_path / "one"), load_safetensors_folder(tmp_path / "three")
    assert one.keys() == three.keys() and all(torch.equal(one[n], three[n]) for n in one)


def test_qwen3_5_vlm_gives_torchtitan_logits_and_vision_features(qwen3_5_written, tmp_path):
    """With transformers' qwen3_5 (the VLM) as config.json, the vision tower is written too (q, k, v weights and
    biases fused as qkv, the patch embedding as a Conv3d), the text model under model.language_model: the text
    logits and the vision tower's features on the same patches are torchtitan's."""
    root, vlm = qwen3_5_written
    proc = _merge(root, tmp_path / "out", hf=vlm / "hf", nproc=2)
    assert "merger: torchtitan qwen3_5 names, written as HF qwen3_5 with its vision tower\n" in proc.stderr
    model = _loaded(tmp_path / "out", "Qwen3_5ForConditionalGeneration", VLM)
    vision = torch.load(vlm / "vision.pt", weights_only=True)
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
        features = model.model.visual(vision["patches"], grid_thw=vision["grid"]).pooler_output
    assert (logits - torch.load(root / "logits.pt", weights_only=True)).abs().max().item() < 1e-4
    assert (features - vision["features"]).abs().max().item() < 1e-4
    _as_save_pretrained_writes(tmp_path / "out", vlm / "hf", tmp_path / "saved", VLM)


def test_qwen3_5_moe_experts_give_torchtitan_logits(qwen3_5_moe_written, tmp_path):
    """Routed experts split per expert as transformers saves them, the gated shared expert, merged on 2 ranks.
    torchtitan multiplies its routed experts in bf16 whatever the model's dtype, so the bound is bf16's: within 2%
    of the largest logit (0.42% on this seed, deterministic on CPU); gate and up swapped is 31% off."""
    root, vlm = qwen3_5_moe_written
    proc = _merge(root, tmp_path / "out", nproc=2)
    logits = _logits(tmp_path / "out", "Qwen3_5MoeForCausalLM")
    titan = torch.load(root / "logits.pt", weights_only=True)
    assert (logits - titan).abs().max().item() < 0.02 * titan.abs().max().item()
    assert torch.equal(logits.argmax(-1), titan.argmax(-1))
    _as_save_pretrained_writes(tmp_path / "out", root / "hf", tmp_path / "saved")
    assert ("written as HF qwen3_5_moe_text; 6 stacked expert tensors split per expert; left out: "
            "layers.0.moe.expert_bias_E (Qwen3.5-MoE routes") in proc.stderr
    # and as the MoE VLM, with its vision tower
    _merge_here(root, tmp_path / "vlm", hf=vlm / "hf")
    vlm_logits = _logits(tmp_path / "vlm", "Qwen3_5MoeForConditionalGeneration", VLM)
    assert (vlm_logits - titan).abs().max().item() < 0.02 * titan.abs().max().item()
    _as_save_pretrained_writes(tmp_path / "vlm", vlm / "hf", tmp_path / "vlm_saved", VLM)


@pytest.fixture(scope="session")
def kimi_written(tmp_path_factory) -> tuple[Path, Path]:
    """The checkpoint, and VLM: VLM/hf (transformers' kimi_k25 of the same model), VLM/vision.pt (torchtitan's
    tower and projector on seeded patches), VLM/to_hf (torchtitan's own to_hf of the unsharded model)."""
    vlm = tmp_path_factory.mktemp("kimi_k25_vlm")
    root = written_by_torchtitan(tmp_path_factory, "kimi_k2_7", "--hf-vlm", vlm / "hf", "--vision",
                                 vlm / "vision.pt", "--reference", vlm / "to_hf")
    return root, vlm


@pytest.fixture(scope="session")
def kimi_root(kimi_written) -> Path:
    return kimi_written[0]


def test_kimi_k2_7_text_model_gives_torchtitan_logits(kimi_root, tmp_path):
    """torchtitan's KimiK25Model (MLA, MoE with a routing bias, a MoonViT vision tower) as HF deepseek_v3, the
    text model transformers' kimi_k25 wraps; merged on 2 ranks."""
    proc = _merge(kimi_root, tmp_path / "out", nproc=2)
    logits = _logits(tmp_path / "out", "DeepseekV3ForCausalLM")
    assert (logits - torch.load(kimi_root / "logits.pt", weights_only=True)).abs().max().item() < 1e-4
    assert "left out: vision_encoder.* (27 tensors: the vision tower" in proc.stderr


def test_kimi_k2_7_vlm_gives_torchtitan_logits_and_vision_features(kimi_written, tmp_path):
    """With transformers' kimi_k25 as config.json, the MoonViT tower and projector are written too, under the
    names of Moonshot's release (q, k, v fused as wqkv in torchtitan's rotary layout, which transformers permutes
    for its own on load; the patch embedding as a Conv2d), the text model under language_model.: the text logits
    and the tower's features on the same patches are torchtitan's, and the folder is torchtitan's own to_hf, tensor
    for tensor. Merged on 2 ranks."""
    root, vlm = kimi_written
    proc = _merge(root, tmp_path / "out", hf=vlm / "hf", nproc=2)
    assert "merger: torchtitan deepseek_v3 names, written as HF kimi_k25 with its vision tower;" in proc.stderr
    model = _loaded(tmp_path / "out", "Kimi_K25ForConditionalGeneration", VLM)
    vision = torch.load(vlm / "vision.pt", weights_only=True)
    side = transformers.AutoConfig.from_pretrained(vlm / "hf").vision_config.patch_size
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits
        features = model.model.get_image_features(vision["patches"].unflatten(1, (3, side, side)),
                                                  vision["grid"]).pooler_output[0]
    assert (logits - torch.load(root / "logits.pt", weights_only=True)).abs().max().item() < 1e-4
    assert (features - vision["features"]).abs().max().item() < 1e-5
    merged, to_hf = load_safetensors_folder(tmp_path / "out"), load_safetensors_folder(vlm / "to_hf")
    assert merged.keys() == to_hf.keys() and all(torch.equal(merged[n], to_hf[n]) for n in merged)


def test_a_kimi_k25_config_for_a_checkpoint_without_the_tower_is_refused(deepseek_v3_root, tmp_path):
    """A torchtitan DeepSeek-V3 has no vision tower: transformers' kimi_k25 (the VLM) as its config.json is refused,
    naming its text_config, and nothing is written."""
    assert refused_as_kimi_k25(deepseek_v3_root, tmp_path) == (
        f"merger: error: config.json is HF kimi_k25, a VLM, but the torchtitan checkpoint holds no vision tower "
        f"(vision_encoder.*): pass a folder whose config.json is this config's text_config (model_type deepseek_v3 "
        f"or kimi_k2) with --hf_model_config_path, {tmp_path / 'hf' / 'config.json'}")
