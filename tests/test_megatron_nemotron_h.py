"""Nemotron-H (HF nemotron_h) Megatron checkpoints merged to HF, checked against Megatron's own forward pass.

megatron-core writes a MambaModel with the hybrid pattern M*M-E (Mamba2 mixer, attention, Mamba2 mixer, relu2 MLP,
MoE with relu2 experts, a shared expert and a sigmoid router with expert bias) at TP2, legacy and torch_dist
(tests/writers/megatron_nemotron_h.py, one torchrun launch of 2 gloo ranks, with the mamba-ssm sdist's source:
tests/helpers/mamba_ssm_source.py). Each TP rank holds its own slice of every section of a Mamba2 in_proj
([z x B C dt]) and conv1d ([x B C]). Oracles: Megatron's CPU logits (transformers' NemotronHForCausalLM on the
merged folder), fp32, max abs diff < 1e-4 with the same argmax; the names and shapes transformers' save_pretrained
writes for the same config; legacy and torch_dist merge to the same bytes, and 2 merge ranks to the bytes 1
writes. The mutations a wrong section layout makes (the rank shards concatenated as they are, B and C swapped)
must fail the logits check.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.mamba_ssm_source import mamba_ssm_source
from tests.helpers.megatron_mtp_models import assert_megatron_logits, load, logits_of, merged_once, oracle
from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow

CASES = {"nemotron_h_tp2": "tp=2"}
CASE = "nemotron_h_tp2"
TP = 2


@pytest.fixture(scope="session")
def nemotron_root(tmp_path_factory, pytestconfig) -> Path:
    cached = getattr(pytestconfig, "cache", None)  # None under `-p no:cacheprovider`: a download per session
    cache = cached.mkdir("mamba_ssm") if cached else tmp_path_factory.mktemp("mamba_ssm")
    source = mamba_ssm_source(Path(cache))
    root = tmp_path_factory.mktemp("megatron_nemotron_h")
    run_writer("megatron_nemotron_h.py", "--out", root,
               *[arg for case, spec in CASES.items() for arg in ("--case", f"{case}:{spec}")], nproc=2,
               env={"PYTHONPATH": str(source)})
    return root


@pytest.fixture(scope="session")
def merged(nemotron_root, tmp_path_factory):
    return merged_once(nemotron_root, tmp_path_factory)


def loaded(folder: Path):
    model, unexpected = load(folder)
    assert not unexpected
    return model


def test_merge_reproduces_megatron_logits(nemotron_root, merged):
    expected = oracle(nemotron_root, CASE)
    model = loaded(merged(CASE, "legacy"))
    assert model.config.layers_block_type == ["linear_attention", "full_attention", "linear_attention", "mlp",
                                              "moe"]
    assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])


def test_torch_dist_merge_equals_legacy_merge(merged):
    assert_same_weights(merged(CASE, "dist"), merged(CASE, "legacy"), None)


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
def test_two_merge_ranks_write_the_bytes_one_writes(fmt, nemotron_root, merged, tmp_path):
    run_merger("merge", "--local_dir", nemotron_root / CASE / fmt, "--target_dir", tmp_path / "out",
               "--hf_model_config_path", nemotron_root / CASE / "hf", "--dtype", "float32", nproc=2)
    one = merged(CASE, fmt)
    weights = sorted(p.name for p in one.glob("*.safetensors"))
    assert weights == sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    for name in weights:
        assert (tmp_path / "out" / name).read_bytes() == (one / name).read_bytes(), name


def test_a_mixer_without_the_tensors_that_size_its_sections_is_refused(nemotron_root, tmp_path):
    """The section sizes of a legacy in_proj come from the layer's A_log, out_proj and conv1d: without A_log the merge
    stops naming the tensor and the file, and writes nothing."""
    src = tmp_path / "ckpt"
    shutil.copytree(nemotron_root / CASE / "legacy", src)
    for rank_file in src.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(rank_file, weights_only=False)  # our own test file
        del state["model"]["decoder.layers.0.mixer.A_log"]
        torch.save(state, rank_file)
    proc = run_merger("merge", "--local_dir", src, "--target_dir", tmp_path / "out", "--hf_model_config_path",
                      nemotron_root / CASE / "hf", check=False)
    assert proc.returncode == 1
    error = single_error_line(proc.stderr)
    assert "decoder.layers.0.mixer.in_proj.weight" in error and "decoder.layers.0.mixer.A_log" in error, error
    assert error.endswith("model_optim_rng.pt"), error
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()


def test_names_and_shapes_are_those_save_pretrained_writes(nemotron_root, merged, tmp_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(nemotron_root / CASE / "hf")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "own")
    own = {n: t.shape for n, t in load_safetensors_folder(tmp_path / "own").items()}
    assert {n: t.shape for n, t in load_safetensors_folder(merged(CASE, "legacy")).items()} == own


def _sections(config) -> dict[str, list[int]]:
    """Row sizes of the sections of a Mamba2 mixer's in_proj and conv1d, whole, from the HF config."""
    inner, states = config.mamba_num_heads * config.mamba_head_dim, config.n_groups * config.ssm_state_size
    return {"in_proj": [inner, inner, states, states, config.mamba_num_heads], "conv1d": [inner, states, states]}


def _as_rank_shards(whole: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The TP ranks' shards one after the other, as a plain concatenation of the rank files would give."""
    sections = [s.chunk(TP) for s in whole.split(sizes)]
    return torch.cat([part[r] for r in range(TP) for part in sections])


def _b_and_c_swapped(whole: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    parts = list(whole.split(sizes))
    b = 2 if len(sizes) == 5 else 1
    parts[b], parts[b + 1] = parts[b + 1], parts[b]
    return torch.cat(parts)


@pytest.mark.parametrize("mutation", [_as_rank_shards, _b_and_c_swapped])
def test_a_wrong_section_layout_fails_the_logits_check(mutation, nemotron_root, merged):
    """The check above would catch a merge that read in_proj and conv1d section-blind."""
    expected = oracle(nemotron_root, CASE)
    model = loaded(merged(CASE, "legacy"))
    sizes = _sections(model.config)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                mixer = layer.mixer
                for tensor, rows in ((mixer.in_proj.weight, sizes["in_proj"]), (mixer.conv1d.weight, sizes["conv1d"]),
                                     (mixer.conv1d.bias, sizes["conv1d"])):
                    tensor.copy_(mutation(tensor.clone(), rows))
    with pytest.raises(AssertionError):
        assert_megatron_logits(logits_of(model, expected["tokens"]), expected["logits"])
