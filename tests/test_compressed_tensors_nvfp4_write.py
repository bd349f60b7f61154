"""`--quantize_like` a compressed-tensors `nvfp4-pack-quantized` release: the output in the release's layout, every
byte of it where training changed nothing, and compressed-tensors' own bytes where it did, the global scale shared
among the layers the release shares it among (#49 items 2 and 3).

The releases are written by compressed-tensors itself (tests/writers/compressed_tensors_release.py: its
`generate_gparam`, `compute_dynamic_scales_and_zp` and `ModelCompressor` on a tiny bfloat16 Llama, as llmcompressor
saves NVFP4A16), their global scales shared as llmcompressor's two tools share them: oneshot across q/k/v and across
gate/up, model_free_ptq across q/k/v only (llmcompressor's rule: the smallest of the layers' global scales). Oracles,
none of them merger's code: the release's own bytes for what training left alone, and the release compressed-tensors
writes of the trained model, with the same sharing, for what it changed. compressed-tensors' rule is no fixed point
on its own output (a negative weight that rounds to 0 is written as -0, which reads back as a 0 it writes as +0): the
tests check that premise too.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.helpers.in_process import merge_in_process, stdout_in_process
from tests.helpers.processes import run_merger
from tests.helpers.release_bytes import (assert_only_changed_groups_redone, groups_differ, same_bytes,
                                        written_back_like)
from tests.helpers.weights import load_safetensors_folder
from tests.writers.compressed_tensors_release import SHARED, TINY, compress_checkpoint, write_release

FMT = "nvfp4-pack-quantized"
PARTS = (".weight_packed", ".weight_scale", ".weight_global_scale")
PACKED, SCALE, GLOBAL = PARTS
GROUP = 16
LOGGED = ("14 tensors written as compressed-tensors NVFP4 like {} (uint8 weight_packed of 2 e2m1 codes, "
          "float8_e4m3fn weight_scale per 16 elements, float32 weight_global_scale); quantization_config copied "
          "into config.json")


O_PROJ = "model.layers.1.self_attn.o_proj"  # its largest magnitude a power of two: it reads back exactly


@pytest.fixture(scope="module", params=list(SHARED))
def plain(request, tmp_path_factory):
    """(the tool whose sharing the release has, its release, the model merger reads from it: bfloat16). The release
    is of the seeded tiny Llama with one weight of O_PROJ set to 0.125, above all of its others."""
    root = tmp_path_factory.mktemp("nvfp4_write")
    torch.manual_seed(0)
    weights = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16).state_dict()
    assert weights[O_PROJ + ".weight"].abs().max() < 0.125
    weights[O_PROJ + ".weight"][1, 2] = 0.125
    release = write_release(root / "release", FMT, weights=weights, shared=SHARED[request.param])
    return request.param, release, merge_in_process(release, root / "bf16")


def modules(state: dict) -> list[str]:
    return [n.removesuffix(SCALE) for n in state if n.endswith(SCALE)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_release_read_and_written_like_itself_is_every_byte_of_it(plain, tmp_path, capsys, dtype):
    tool, release, bf16 = plain
    stored = written_back_like(release, bf16, tmp_path / "back", dtype)
    assert len(modules(stored)) == 14
    config, release_config = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "back", release))
    assert config["quantization_config"] == release_config["quantization_config"]
    # the release shares its global scales as its tool does: q/k/v always, gate/up for oneshot only
    layer = "model.layers.0."
    qkv = [stored[f"{layer}self_attn.{p}_proj{GLOBAL}"] for p in "qkv"]
    gate_up = [stored[f"{layer}mlp.{p}_proj{GLOBAL}"] for p in ("gate", "up")]
    assert all(same_bytes(g, qkv[0]) for g in qkv)
    assert same_bytes(*gate_up) == (tool == "oneshot")
    # the premise: compressed-tensors itself, on the values read back, writes other bytes somewhere (-0 as +0)
    again = load_safetensors_folder(write_release(tmp_path / "again", FMT, weights=load_safetensors_folder(bf16),
                                                  shared=SHARED[tool]))
    assert any(groups_differ(m, (PACKED, SCALE), again, stored).any() for m in modules(stored))
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert LOGGED.format(release) in notes


def _trained(bf16, folder, layer0: list[str], q: str, gate: str, o: str) -> dict[str, torch.Tensor]:
    """`bf16`'s model after "training", saved as HF folder `folder`: every weight of `layer0` plus a seeded random
    delta; one element of `q` and of `o` (their smallest magnitude: no largest changes) plus 0.01; and one element
    of `gate` set to four times the largest magnitude of gate/up."""
    weights = load_safetensors_folder(bf16)
    torch.manual_seed(3)
    for name in layer0:
        weights[name] = weights[name] + (torch.randn(weights[name].shape) / 500).to(weights[name].dtype)
    for name in (q, o):
        weights[name] = weights[name].clone()
        weights[name][divmod(int(weights[name].abs().argmin()), weights[name].shape[1])] += 0.01
    weights[gate] = weights[gate].clone()
    weights[gate][0, 0] = 4 * max(weights[gate].abs().max(), weights[gate.replace("gate", "up")].abs().max())
    shutil.copytree(bf16, folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return weights


def test_after_training_unchanged_tensors_keep_their_bytes_and_changed_ones_are_compressed_tensors(plain, tmp_path):
    """Training changed every weight of layer 0, one element each of layer 1's q_proj and o_proj, and the largest
    element of layer 1's gate_proj.
    - A global scale is computed again from its set's weights as they now are, and those read back from the release
      have another largest magnitude than the weights the release was made of: q_proj's global scale changes, and
      with it k_proj's and v_proj's, which are requantized although training left them alone; gate_proj's changes,
      and up_proj's with it where it is shared (oneshot), not where it is not (model_free_ptq: up_proj keeps its
      bytes). Each of these is compressed-tensors' bytes, as is layer 0.
    - o_proj's largest magnitude is a power of two (0.125, the release's weights made so), which reads back exactly:
      its global scale stays the release's, so the group training changed is compressed-tensors' and every other
      group keeps the release's bytes (the block-level rule).
    Every other tensor is the release's bytes."""
    tool, release, bf16 = plain
    stored = load_safetensors_folder(release)
    layer0 = [m + ".weight" for m in modules(stored) if m.startswith("model.layers.0.")]
    assert len(layer0) == 7
    q, gate, o = "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.gate_proj", O_PROJ
    weights = _trained(bf16, tmp_path / "trained", layer0, q + ".weight", gate + ".weight", o + ".weight")
    got = load_safetensors_folder(merge_in_process(tmp_path / "trained", tmp_path / "out", "--quantize_like",
                                                  release, "--verify"))
    want = load_safetensors_folder(write_release(tmp_path / "want", FMT, weights=weights, shared=SHARED[tool]))
    assert sorted(got) == sorted(stored)

    kv = [q.replace("q_proj", p) for p in ("k_proj", "v_proj")]
    up = gate.replace("gate", "up")
    redone = [m.removesuffix(".weight") for m in layer0] + [q, *kv, gate] + ([up] if tool == "oneshot" else [])
    for name in (m + part for m in redone for part in PARTS):
        assert same_bytes(got[name], want[name]), name
    for m in (q, gate):  # the premise: the global scales had to change, and the unchanged members with them
        assert not same_bytes(want[m + GLOBAL], stored[m + GLOBAL])
    assert groups_differ(kv[0], (PACKED, SCALE), want, stored).any()
    if tool == "oneshot":
        assert groups_differ(up, (PACKED, SCALE), want, stored).any()

    # o_proj: its global scale stays, so only the changed group is compressed-tensors'
    assert same_bytes(want[o + GLOBAL], stored[o + GLOBAL]) and same_bytes(got[o + GLOBAL], stored[o + GLOBAL])
    moved = assert_only_changed_groups_redone(o, (PACKED, SCALE), load_safetensors_folder(bf16)[o + ".weight"],
                                              weights[o + ".weight"], got, want, stored, GROUP)
    assert (groups_differ(o, (PACKED, SCALE), want, got) & ~moved).any()  # kept, not redone

    written = {m + part for m in (*redone, o) for part in PARTS}
    for name in set(stored) - written:
        assert same_bytes(got[name], stored[name]), name


def test_a_w4a4_release_keeps_its_activations_calibration(ct_release, tmp_path, capsys):
    """NVFP4 W4A4 (compressed-tensors' NVFP4 preset, with `input_global_scale`s): written back every byte, the
    activations' calibration copied from the release (merger has no data to calibrate on), and the log says so."""
    release = ct_release("nvfp4 W4A4")
    bf16 = merge_in_process(release, tmp_path / "bf16")
    stored = written_back_like(release, bf16, tmp_path / "back", "bfloat16")
    assert sum(name.endswith(".input_global_scale") for name in stored) == 14  # compressed-tensors wrote them
    notes = json.loads(stdout_in_process(capsys, "inspect", "--local_dir", bf16, "--quantize_like", release,
                                         "--json"))["notes"]
    assert LOGGED.format(release).replace("weight_global_scale)", "weight_global_scale, float32 input_global_scale "
                                          "the release's)") in notes


def test_merge_ranks_write_the_bytes_one_process_writes(plain, tmp_path):
    """The layers that share a global scale are quantized in one step (the scale needs all of them): 2 merge ranks,
    with a budget that splits the merge into batches, write the bytes 1 process does, after training changed
    layers of every kind of set."""
    _, release, bf16 = plain
    stored = load_safetensors_folder(release)
    layer0 = [m + ".weight" for m in modules(stored) if m.startswith("model.layers.0.")]
    _trained(bf16, tmp_path / "trained", layer0, "model.layers.1.self_attn.q_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", O_PROJ + ".weight")
    for nproc in (1, 2):
        run_merger("merge", "--local_dir", tmp_path / "trained", "--target_dir", tmp_path / f"out-{nproc}",
                   "--quantize_like", release, "--max_inflight", "16KiB", nproc=nproc)
    one, two = load_safetensors_folder(tmp_path / "out-1"), load_safetensors_folder(tmp_path / "out-2")
    assert sorted(one) == sorted(two) == sorted(stored)
    assert all(same_bytes(one[n], two[n]) for n in one)
    assert not all(same_bytes(one[n], stored[n]) for n in one)  # training changed what was written


# A tiny Qwen3-MoE: 4 routed experts 32 wide, attention 4 heads of 16: every Linear layer whole groups of 16
QWEN3_MOE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, tie_word_embeddings=False)
# what llmcompressor's model_free_ptq is told to leave alone (it quantizes every 2-dim weight, norms aside)
MODEL_FREE_PTQ_IGNORE = ["model.embed_tokens", "lm_head", "re:.*mlp.gate$"]


@pytest.mark.parametrize("scales", ["different", "equal"])
def test_a_moe_release_made_by_model_free_ptq_is_read_as_compressed_tensors_reads_it_and_written_back(tmp_path, scales):
    """A Qwen3-MoE release as llmcompressor 0.14.0.1's `model_free_ptq(..., scheme="NVFP4A16")` writes it: each
    expert's projections their own Linear layers, the global scale shared across q/k/v only, each expert's gate and
    up their own; config.json's quantization_config as it writes it (its group named after the scheme, `ignore` with
    the regex it was given). compressed_tensors_release.compress_checkpoint writes model_free_ptq's bytes for this
    model, every tensor, and the quantization_config (checked here against llmcompressor 0.14.0.1's own output).
    - merger reads it as compressed-tensors' dequantizer does, bit for bit;
    - written back with `--quantize_like`, every byte and the quantization_config are the release's;
    - after training changed one expert's gate_proj, that layer is what compressed-tensors writes for it, and its
      up_proj, which shares no scale with it in this release, keeps its bytes (as every other tensor): both where the
      tool gave the two different global scales and where they came out equal without being shared (other experts'
      differ, so no expert's are read as shared)."""
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "plain")
    weights = load_safetensors_folder(tmp_path / "plain")  # one tensor per expert and projection, as released
    linear = sorted(n for n, t in weights.items() if t.dim() == 2)

    def release_of(weights: dict, folder) -> dict:
        tensors, config = compress_checkpoint(folder, weights, FMT, linear, MODEL_FREE_PTQ_IGNORE,
                                              SHARED["model_free_ptq"])
        config = dict(config, config_groups={"NVFP4A16": config["config_groups"]["group_0"]},
                      ignore=MODEL_FREE_PTQ_IGNORE)
        del config["sparsity_config"]  # model_free_ptq writes none
        plain = json.loads((tmp_path / "plain" / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(plain, quantization_config=config)))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return tensors

    expert = "model.layers.1.mlp.experts.0."
    if scales == "equal":  # the same largest magnitude, so the same global scale, though the tool shares none
        gate_up = [weights[expert + part + ".weight"].view(-1) for part in ("gate_proj", "up_proj")]
        top = max(w.abs().max() for w in gate_up)
        for w in gate_up:
            w[w.abs().argmax()] = top
    stored = release_of(weights, tmp_path / "release")
    release = tmp_path / "release"
    assert len(modules(stored)) == 2 * (4 + 4 * 3)
    if scales == "different":  # the weights as saved: the release is what llmcompressor itself writes, every byte
        from llmcompressor import model_free_ptq

        model_free_ptq(str(tmp_path / "plain"), str(tmp_path / "tool"), scheme="NVFP4A16",
                       ignore=MODEL_FREE_PTQ_IGNORE, device="cpu")
        tool = load_safetensors_folder(tmp_path / "tool")
        assert sorted(tool) == sorted(stored) and all(same_bytes(tool[n], stored[n]) for n in stored)
        assert (json.loads((tmp_path / "tool" / "config.json").read_text())["quantization_config"]
                == json.loads((release / "config.json").read_text())["quantization_config"])
    gate = expert + "gate_proj"
    assert same_bytes(stored[gate + GLOBAL], stored[expert + "up_proj" + GLOBAL]) == (scales == "equal")

    bf16 = merge_in_process(release, tmp_path / "bf16")
    got = load_safetensors_folder(bf16)
    want = CompressedTensorsDequantizer(release, dtype=torch.bfloat16).process(dict(stored))
    assert sorted(got) == sorted(want)
    assert all(same_bytes(got[n], want[n]) for n in want)

    written_back_like(release, bf16, tmp_path / "back", "bfloat16")
    assert (json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
            == json.loads((release / "config.json").read_text())["quantization_config"])

    got[gate + ".weight"] = got[gate + ".weight"] * 1.5  # its largest magnitude, and so its global scale, change
    shutil.copytree(bf16, tmp_path / "trained")
    save_file(got, str(tmp_path / "trained" / "model.safetensors"), metadata={"format": "pt"})
    out = load_safetensors_folder(merge_in_process(tmp_path / "trained", tmp_path / "out", "--quantize_like", release))
    redone = release_of(got, tmp_path / "want")
    assert not same_bytes(redone[gate + GLOBAL], stored[gate + GLOBAL])
    assert all(same_bytes(out[gate + part], redone[gate + part]) for part in PARTS)
    assert all(same_bytes(out[n], stored[n]) for n in stored if not n.startswith(gate + "."))
