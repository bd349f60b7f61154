"""gpt-oss's MoE experts written in MXFP4, as the gpt-oss release stores them: `--quantize mxfp4` and
`--quantize_like` a gpt-oss MXFP4 release.

The model is a tiny random gpt-oss (transformers' GptOssConfig, 2 layers of 4 experts; gate_up_proj [4, 64, 192] and
down_proj [4, 96, 64], so `in` holds 2 and 3 blocks of 32 and `in` != `out`) saved by save_pretrained in bfloat16.
Oracles: transformers' own CPU dequantizer of the release format (`convert_moe_packed_tensors`, what
`from_pretrained` runs on CPU), transformers loading the output, and an MXFP4 release made in the test from random
bytes (its bf16 model is transformers' dequantization of them). transformers' quantizer is no oracle here: its
arithmetic ships in the gpt-oss Triton kernels package that transformers fetches from the Hub at run time
(`kernels`), and no machine of this project reaches the Hub.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.quantizers.quantizers_utils import should_convert_module

from tests.helpers.files import snapshot
from tests.helpers.in_process import merge_here
from tests.helpers.processes import run_merger
from tests.helpers.weights import load_safetensors_folder
from tests.writers.tiny_models import build_model

pytestmark = pytest.mark.slow

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the e2m1 magnitudes (OCP MX spec)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             max_position_embeddings=64, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
EXPERTS = ("gate_up_proj", "down_proj")
TOKENS = torch.tensor([[1, 5, 7, 9, 11, 3, 42, 60, 2, 100, 17, 4]])
# the release's own choice, unlike --quantize mxfp4's: --quantize_like must copy it
RELEASE_QC = {"quant_method": "mxfp4",
              "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                         "lm_head", "model.norm"]}


def expert_weights(state: dict) -> list[str]:
    return sorted(n for n in state if n.rsplit(".", 1)[-1] in EXPERTS)


def save_gpt_oss(folder, experts=None, seed=0):
    """A seeded bf16 gpt-oss; each expert block of 32 `in` elements scaled by its own power of two (a scale per
    block, so a blocking along the wrong dim shows), or the expert weights given (name -> tensor)."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SIZES)).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if experts is not None and name in experts:
                param.copy_(experts[name])
            elif name.rsplit(".", 1)[-1] in EXPERTS:
                e, rows, cols = param.shape
                param.mul_(2.0 ** torch.randint(-4, 5, (e, rows // 32, 1, cols)).repeat_interleave(32, 1)
                           .reshape(e, rows, cols))
            else:
                param.add_(torch.randn_like(param) * 0.02)  # biases and norms too
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return save_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "bf16")


def write_release(root, seed: int, minimal_scales: bool) -> tuple:
    """(an MXFP4 release of random bytes, its bf16 model: transformers' dequantization of those bytes, the
    release's packed tensors, the model's experts). `minimal_scales`: each block holds a ±4 or ±6 (so its scale is
    the one the block needs: its max / 6 rounds up to that power of two); else the first block of each row has no
    magnitude above 1.5 (a scale 4 times smaller holds it). Scales 2^-9..2^8; the router's bias is stored in
    float32 (a dtype of the release's own), the rest in bf16."""
    torch.manual_seed(seed)
    shapes = {"gate_up_proj": (4, 2 * 96, 64), "down_proj": (4, 64, 96)}  # [E, out, in]
    packed, experts = {}, {}
    for layer in range(SIZES["num_hidden_layers"]):
        for proj, (e, out, rows) in shapes.items():
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks = torch.randint(0, 256, (e, out, rows // 32, 16), dtype=torch.uint8)
            if minimal_scales:
                top = torch.randint(6, 8, (e, out, rows // 32), dtype=torch.uint8)  # magnitude code of 4 or 6
                blocks[..., 0] = (blocks[..., 0] & 0xF0) | top | (blocks[..., 0] & 0x08)
            else:
                blocks[:, :, 0] &= 0xBB  # each code's magnitude bit 2 cleared: 1.5 at most
            scales = torch.randint(127 - 9, 127 + 9, (e, out, rows // 32), dtype=torch.uint8)
            packed |= {name + "_blocks": blocks, name + "_scales": scales}
            experts[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    model_dir = save_gpt_oss(root / "bf16", experts, seed=2)
    state = load_safetensors_folder(model_dir)
    stored = {n: (t.float() if n.endswith("router.bias") else t) for n, t in state.items() if n not in experts}
    (root / "release").mkdir()
    save_file({**stored, **packed}, str(root / "release" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (root / "release" / "config.json").write_text(json.dumps({**config, "quantization_config": RELEASE_QC}))
    return root / "release", model_dir, packed, experts


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(an MXFP4 release whose scales are the ones its blocks need, its bf16 model)."""
    return write_release(tmp_path_factory.mktemp("mxfp4_release"), seed=1, minimal_scales=True)[:2]


def test_transformers_dequantizer_reads_the_experts_within_mxfp4_error(gpt_oss, tmp_path, capsys):
    """The bound: with X = 2^(scale - 127) the block's scale, MXFP4 holds s * g * X for g in {0, 0.5, 1, 1.5, 2,
    3, 4, 6}. The scale must be the smallest power of two with max|w| / X <= 6 (so max|w| / X lies in (3, 6]):
    every |w| / X is then within the grid's range, nothing saturates, and round-to-nearest errs by at most half
    the gap between the two grid values around it: 0.25 X below 2 X, 0.5 X from 2 X to 4 X, X from 4 X to 6 X.
    Stronger: no grid value at that scale is nearer to w than the one transformers reads back."""
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", gpt_oss, "--target_dir", out, "--quantize", "mxfp4") == (0, [])
    got, model = load_safetensors_folder(out), load_safetensors_folder(gpt_oss)
    quantized = expert_weights(model)
    assert len(quantized) == 4
    assert set(got) == (set(model) - set(quantized)) | {n + s for n in quantized for s in ("_blocks", "_scales")}
    for name in quantized:
        w, blocks, scales = model[name].float(), got[name + "_blocks"], got[name + "_scales"]
        e, rows, cols = w.shape
        assert blocks.dtype == scales.dtype == torch.uint8
        assert blocks.shape == (e, cols, rows // 32, 16) and scales.shape == (e, cols, rows // 32)
        back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert back.shape == w.shape, name
        x = (2.0 ** (scales.double() - 127)).float()  # [E, out, in / 32]
        by_block = w.transpose(1, 2).reshape(e, cols, rows // 32, 32)
        ratio = by_block.abs().amax(-1) / x
        assert ((ratio > 3) & (ratio <= 6)).all(), name
        x = x.repeat_interleave(32, -1).transpose(1, 2)  # each element's block scale, [E, in, out]
        q = w.abs() / x
        half_step = torch.where(q < 2, 0.25, torch.where(q < 4, 0.5, 1.0)) * x
        err = (back - w).abs()
        assert (err <= half_step).all(), name
        nearest = (w.abs().unsqueeze(-1) - E2M1 * x.unsqueeze(-1)).abs().amin(-1)
        assert torch.equal(err, nearest), name
        assert torch.equal(torch.signbit(back) | (back == 0), torch.signbit(w) | (back == 0)), name
    for name in set(model) - set(quantized):
        assert torch.equal(got[name], model[name]), name  # bf16, as --dtype
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    skip = transformers.Mxfp4Config(**qc).modules_to_not_convert
    assert qc["quant_method"] == "mxfp4"
    modules = {n.rsplit(".", 1)[0] for n in model if "norm" not in n}  # norms: never a module MXFP4 converts
    assert {m for m in modules if should_convert_module(m, skip)} == {m.rsplit(".", 1)[0] for m in quantized}


def test_transformers_loads_the_output_on_cpu(tmp_path, capsys):
    """transformers 5.24 on CPU without its MXFP4 kernels dequantizes on load (its Mxfp4Dequantize, through
    convert_moe_packed_tensors): every tensor loads, the experts are its dequantization of the files, the rest the
    bf16 model's, and its logits are exactly those of the bf16 model carrying those experts.

    Against the bf16 model itself (as transformers initializes it: weights of std 0.02), the logits stay within
    20% of the largest: MXFP4's 3 bits leave the experts ~12% RMS relative error, and a changed top-2 routing
    can add more; measured here 8%. Layout mistakes move them by 60-90% on this model (experts read as zero 61%,
    the two nibbles of a byte swapped 92%, every scale one too large 71%)."""
    torch.manual_seed(0)
    source = tmp_path / "bf16"
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**SIZES)).to(torch.bfloat16).save_pretrained(source)
    out = tmp_path / "out"
    assert merge_here(capsys, "--local_dir", source, "--target_dir", out, "--quantize", "mxfp4") == (0, [])
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    files = load_safetensors_folder(out)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    want = dict(bf16.state_dict())
    for name in expert_weights(want):
        want[name] = convert_moe_packed_tensors(files[name + "_blocks"], files[name + "_scales"], dtype=torch.bfloat16)
    have = loaded.state_dict()
    assert sorted(have) == sorted(want) and all(torch.equal(have[n], want[n]) for n in want)
    expected = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    expected.load_state_dict(want)
    with torch.no_grad():
        reference, exact, logits = (m(TOKENS).logits.float() for m in (bf16, expected, loaded.eval()))
    assert torch.equal(logits, exact)
    assert 0 < (logits - reference).abs().max() < 0.2 * reference.abs().max()


def test_values_on_the_mxfp4_grid_round_trip_byte_for_byte(release, tmp_path, capsys):
    """The model transformers dequantizes from a release's bytes, quantized again, is those bytes: by
    --quantize mxfp4 and by --quantize_like the release, which also gives each other tensor the release's dtype and
    config.json the release's quantization_config. transformers reads the release and both outputs alike."""
    folder, model_dir = release
    stored = load_safetensors_folder(folder)
    assert merge_here(capsys, "--local_dir", model_dir, "--target_dir", tmp_path / "q", "--quantize",
                      "mxfp4") == (0, [])
    assert merge_here(capsys, "--local_dir", model_dir, "--target_dir", tmp_path / "like", "--quantize_like",
                      folder) == (0, [])
    quantized, like = load_safetensors_folder(tmp_path / "q"), load_safetensors_folder(tmp_path / "like")
    assert sorted(quantized) == sorted(like) == sorted(stored)
    packed = [n for n in stored if n.endswith(("_blocks", "_scales"))]
    assert len(packed) == 8
    for name in packed:
        assert torch.equal(quantized[name], stored[name]) and torch.equal(like[name], stored[name]), name
    for name in set(stored) - set(packed):
        assert like[name].dtype == stored[name].dtype and torch.equal(like[name], stored[name]), name
    assert quantized["model.layers.0.mlp.router.bias"].dtype == torch.bfloat16  # --dtype, without a release
    assert json.loads((tmp_path / "like" / "config.json").read_text())["quantization_config"] == RELEASE_QC
    weights = [transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.bfloat16).state_dict()
               for f in (folder, tmp_path / "like")]
    assert all(torch.equal(weights[0][n], weights[1][n].to(weights[0][n].dtype)) for n in weights[0])


def test_quantize_mxfp4_on_another_model_is_one_error_line(tmp_path, capsys):
    llama = tmp_path / "llama"
    build_model("llama", hidden=64).save_pretrained(llama)
    before = snapshot(llama)
    code, errors = merge_here(capsys, "--local_dir", llama, "--target_dir", tmp_path / "out", "--quantize", "mxfp4")
    assert code == 1 and errors == [f"merger: error: --quantize mxfp4 writes gpt-oss's MoE experts as the gpt-oss "
                                    f"release stores them, and this model is 'llama' (config.json's model_type), not "
                                    f"gpt_oss, {llama / 'config.json'}"]
    assert not (tmp_path / "out").exists() and snapshot(llama) == before


def test_quantize_like_an_mxfp4_release_of_another_model_is_refused(release, tmp_path, capsys):
    folder, _ = release
    llama = tmp_path / "llama"
    build_model("llama", hidden=64).save_pretrained(llama)
    code, errors = merge_here(capsys, "--local_dir", llama, "--target_dir", tmp_path / "out", "--quantize_like", folder)
    assert code == 1 and errors == [f"merger: error: no tensor of the output is stored as _blocks and _scales in the "
                                    f"MXFP4 release (4 quantized tensors, none of them here): --quantize_like needs "
                                    f"the release of this model, {folder}"]
    assert not (tmp_path / "out").exists()


def test_an_expert_dim_that_is_not_whole_blocks_is_refused(tmp_path, capsys):
    """transformers' dequantizer reads whole blocks of 32 only: `in` = 48 has no MXFP4 layout it loads."""
    folder = tmp_path / "gpt_oss_48"
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**SIZES, "intermediate_size": 48})).save_pretrained(
        folder)
    code, errors = merge_here(capsys, "--local_dir", folder, "--target_dir", tmp_path / "out", "--quantize", "mxfp4")
    assert code == 1 and errors == [f"merger: error: tensor model.layers.0.mlp.experts.down_proj is [4, 48, 64]: "
                                    f"MXFP4 stores an expert weight [experts, in, out] in blocks of 32 along `in`, "
                                    f"which must be a multiple of 32 (transformers' dequantizer reads no partial "
                                    f"block), {folder / 'config.json'}"]
    assert not (tmp_path / "out").exists()


def test_merge_ranks_equal_one_process_over_fsdp_shards(fsdp_checkpoint, tmp_path):
    """A verl FSDP2 checkpoint of a bf16 gpt-oss saved on 2 ranks, merged by 1 and by 2 ranks with a budget that
    splits the batches: the same bytes."""
    actor, _ = fsdp_checkpoint("gpt_oss", world=2, extra=("--hidden", "64", "--dtype", "bfloat16"))
    for nproc in (1, 2):
        run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / f"out-{nproc}", "--quantize", "mxfp4",
                   "--max_inflight", "16KiB", nproc=nproc)
    one, two = (load_safetensors_folder(tmp_path / f"out-{n}") for n in (1, 2))
    assert sum(t.dtype == torch.uint8 for t in one.values()) == 8
    assert sorted(one) == sorted(two) and all(torch.equal(one[n], two[n]) for n in one)
    files = [snapshot(tmp_path / f"out-{n}")["model.safetensors"][0] for n in (1, 2)]
    assert files[0] == files[1]


def test_quantize_like_keeps_the_release_s_bytes_where_training_changed_nothing(tmp_path, capsys):
    """A release of random bytes: -0 codes, and scales larger than their block needs (the first block of each row
    has no magnitude above 1.5, so a scale 4 times smaller holds it), which quantizing its values again would not
    give back (`--quantize mxfp4` on the same model: checked). Training then changed one expert of layer 1's
    gate_up_proj whole and one element of an expert of layer 0's down_proj. Written like the release: every block
    training left alone is the release's bytes (the oracle: the release); each changed block is what `--quantize mxfp4` (the rule checked against transformers' dequantizer above) writes for it."""
    folder, _, packed, experts = write_release(tmp_path, seed=4, minimal_scales=False)
    whole, part = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    trained = dict(experts)
    trained[whole], trained[part] = experts[whole].clone(), experts[part].clone()
    trained[whole][2] += (torch.randn(trained[whole][2].shape) / 8).to(torch.bfloat16)  # expert 2, [in, out]
    trained[part][1, 40, 7] += 1  # expert 1, in 40: block 1 of `in` for out 7
    trained_dir = save_gpt_oss(tmp_path / "trained", trained, seed=2)
    assert merge_here(capsys, "--local_dir", trained_dir, "--target_dir", tmp_path / "like", "--quantize_like",
                      folder, "--verify") == (0, [])
    assert merge_here(capsys, "--local_dir", trained_dir, "--target_dir", tmp_path / "q", "--quantize",
                      "mxfp4") == (0, [])
    like, redone = load_safetensors_folder(tmp_path / "like"), load_safetensors_folder(tmp_path / "q")

    changed = {name: torch.zeros(packed[name + "_scales"].shape, dtype=torch.bool) for name in experts}
    changed[whole][2] = True
    changed[part][1, 7, 1] = True
    for name, blocks_changed in changed.items():
        for suffix, where in (("_blocks", blocks_changed.unsqueeze(-1)), ("_scales", blocks_changed)):
            got, release, rule = like[name + suffix], packed[name + suffix], redone[name + suffix]
            assert torch.equal(torch.where(where, rule, release), got), name + suffix
    # the premise: the rule alone gives other bytes in blocks training left unchanged
    assert (redone[part + "_scales"][..., 0] < packed[part + "_scales"][..., 0]).all()
    assert like[part + "_scales"][1, 7, 0] == packed[part + "_scales"][1, 7, 0]  # beside the changed block
    stored = load_safetensors_folder(folder)
    for name in set(stored) - set(packed):
        assert like[name].dtype == stored[name].dtype and torch.equal(like[name], stored[name]), name


def test_a_slab_of_experts_keeps_the_release_s_bytes_of_those_experts(tmp_path):
    """Where experts are written a slab at a time (Megatron's and torchtitan's experts, one step each), the
    release's bytes kept are those of the slab's own experts: expert 1 alone, its values the release's, is written
    as the release's expert 1, also in the blocks whose scales the rule alone would lower."""
    from merger.mapping import mxfp4_layout
    from merger.mapping.steps import OutputSpec

    folder, _, packed, experts = write_release(tmp_path, seed=5, minimal_scales=False)
    layout = mxfp4_layout.release_layout(folder, {name: tuple(t.shape) for name, t in experts.items()})
    for name, weight in experts.items():
        spec = OutputSpec(name, tuple(weight.shape), torch.bfloat16, rows=(1, 2))
        blocks, scales = layout.quantize(weight[1:2], spec)
        assert torch.equal(blocks, packed[name + "_blocks"][1:2]) and torch.equal(scales, packed[name + "_scales"][1:2])
