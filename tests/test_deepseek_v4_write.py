"""`--quantize_like` a DeepSeek-V4 release (FP8 ue8m0 in 128x128 blocks, FP4 experts in blocks of 1x32, every scale
float8_e8m0fnu) writes it back (#49 items 2 and 3). The release is the one tests/test_deepseek_v4_read.py reads
(tests/writers/deepseek_v4_release.py: transformers' own `deepseek_v4` as save_pretrained names it).

Oracles, none of them merger's code:
- the release's own bytes, names, dtypes and config, for whatever training left alone;
- transformers' `Fp8Quantize` (ue8m0, 128x128) for a dense weight training changed;
- for an expert training changed, DeepSeek's own FP4 quantizer, `fp4_quant_kernel` of the inference code DeepSeek
  ships with V4 (`inference/kernel.py`), retyped in torch (tests/helpers/deepseek_v4_quantizers.py: it needs
  TileLang and a CUDA GPU): transformers has no FP4 quantizer. Its output is checked here against transformers'
  dequantizer (`Fp8Dequantize._dequantize_one`, which reads FP4 pairs with `_unpack_fp4`): every element the
  nearest value of its block's e2m1 grid.
The premise that makes byte identity a test: quantizing the release's own values again by that rule gives other
bytes in many blocks (a block whose largest code is 3 comes back with half the scale), and the release has -0 codes.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from tests.helpers.deepseek_v4_quantizers import E2M1, GROUP, deepseek_fp4, fp8_quantized
from tests.helpers.in_process import merge_in_process
from tests.helpers.processes import run_merger
from tests.helpers.release_bytes import bits, trained, written_back_like
from tests.helpers.weights import load_safetensors_folder
from tests.writers.deepseek_v4_release import QUANTIZATION_CONFIG, SCALE, with_float4_experts

pytestmark = pytest.mark.slow


def transformers_dequantized(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(SimpleNamespace())._dequantize_one(packed.view(torch.int8), scales.view(torch.float8_e8m0fnu),
                                                           torch.float32)


def group_bytes(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 32, 16]: each block's 16 bytes of codes."""
    return bits(packed).unflatten(-1, (-1, GROUP // 2))


def test_the_fp4_rule_is_deepseek_s_and_reads_back_as_the_nearest_e2m1_values():
    """merger's FP4 rule on weights with every case in it: blocks of random magnitudes, an all-zero block, -0.0,
    values at every tie between two e2m1 codes, a block whose amax / 6 is a power of two, float32 subnormals."""
    from merger.mapping.fp4_experts_quantize import quantize

    torch.manual_seed(0)
    w = torch.randn(6, 256) * torch.pow(2.0, torch.randint(-20, 4, (6, 8)).float()).repeat_interleave(GROUP, -1)
    w[0, :GROUP] = 0
    w[0, GROUP:2 * GROUP] = -0.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # amax 6: the scale 1
    w[1, :16] = torch.cat([ties, -ties])
    w[1, 16:GROUP] = 0.1
    w[2, :GROUP] *= 6 * 2.0**-3 / w[2, :GROUP].abs().max()
    w[3, :GROUP] = torch.randn(GROUP) * 2.0**-140
    for dtype in (torch.bfloat16, torch.float32):
        weight = w.to(dtype)
        packed, scales = quantize(torch.int8, torch.float8_e8m0fnu, weight)
        want = deepseek_fp4(weight)
        assert packed.dtype == torch.int8 and scales.dtype == torch.float8_e8m0fnu
        assert torch.equal(bits(packed), want[0]) and torch.equal(bits(scales), want[1])
        got = transformers_dequantized(packed, scales)
        scale = scales.to(torch.float32).repeat_interleave(GROUP, -1)
        grid = (torch.cat([E2M1, -E2M1]) * scale.unsqueeze(-1))
        off = (got - weight.float()).abs()
        assert torch.equal(off, (grid - weight.float().unsqueeze(-1)).abs().amin(-1))  # no grid value nearer
        assert bool((off <= scale).all())  # half the largest e2m1 step (4 to 6)
    assert bits(packed)[0, 16:32].eq(0x88).all()  # -0.0 keeps its sign: -0 codes


def test_release_read_and_written_like_itself_is_every_byte_of_it(deepseek_v4, tmp_path):
    release, bf16 = deepseek_v4
    for dtype in ("bfloat16", "float32"):
        stored = written_back_like(release, bf16, tmp_path / dtype, dtype)
        config = json.loads((tmp_path / dtype / "config.json").read_text())
        assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert json.loads((tmp_path / "bfloat16" / "config.json").read_text()) == json.loads(
        (release / "config.json").read_text())  # float32's says `dtype: float32`, as any merge at float32
    merged = load_safetensors_folder(bf16)
    experts = [n for n, t in stored.items() if t.dtype == torch.int8]
    assert len(experts) == 24 and all(stored[n + SCALE].dtype == torch.float8_e8m0fnu for n in experts)
    assert sum(t.dtype == torch.float8_e4m3fn for t in stored.values()) == 20
    # the premise: DeepSeek's rule on the values read back gives other bytes in some blocks, and -0 codes are there
    redone = sum(int((deepseek_fp4(merged[n])[1] != bits(stored[n + SCALE])).sum()) for n in experts)
    assert redone > 0, redone
    assert any(((bits(stored[n]) & 0xF) == 8).any() for n in experts)


def test_after_training_unchanged_tensors_and_blocks_keep_their_bytes_and_two_ranks_write_the_same(deepseek_v4,
                                                                                                    tmp_path):
    """Training changed a dense FP8 weight and an expert of layer 0 whole, and one element of an expert of layer 1:
    the dense weight is Fp8Quantize's bytes, the expert DeepSeek's rule's, the partly changed expert DeepSeek's rule's
    in its changed block and the release's in every other (some of which the rule would write otherwise), every other
    tensor the release's bytes. Merged by 2 ranks with a budget that splits the batches: the same files."""
    release, bf16 = deepseek_v4
    stored, merged = load_safetensors_folder(release), load_safetensors_folder(bf16)
    dense, expert = "model.layers.0.attn.wq_a.weight", "model.layers.0.ffn.experts.1.w1.weight"
    partly = "model.layers.1.ffn.experts.2.w2.weight"
    differs = deepseek_fp4(merged[partly])[1] != bits(stored[partly + SCALE])
    row, block = (int(i) for i in differs.nonzero()[0])
    changed = (row, block + 1 if block + 1 < differs.shape[1] else block - 1)  # a block next to one the rule redoes
    assert bool(differs[row, block]) and (row, block) != changed
    assert stored[dense].dtype == torch.float8_e4m3fn and stored[expert].dtype == torch.int8
    source, weights = trained(bf16, [dense, expert], partly, (changed[0], changed[1] * GROUP + 3), tmp_path / "trained")
    got = load_safetensors_folder(merge_in_process(source, tmp_path / "out", "--quantize_like", release, "--verify"))

    assert sorted(got) == sorted(stored)
    codes, scale = fp8_quantized(dense, weights[dense])
    assert torch.equal(bits(got[dense]), bits(codes)) and torch.equal(bits(got[dense + SCALE]), scale)
    assert not torch.equal(bits(got[dense]), bits(stored[dense]))
    packed, scales = deepseek_fp4(weights[expert])
    assert torch.equal(bits(got[expert]), packed) and torch.equal(bits(got[expert + SCALE]), scales)
    packed, scales = deepseek_fp4(weights[partly])
    moved = torch.zeros(differs.shape, dtype=torch.bool)
    moved[changed] = True
    assert torch.equal(group_bytes(got[partly])[moved], group_bytes(packed.view(torch.int8))[moved])
    assert torch.equal(bits(got[partly + SCALE])[moved], scales[moved])
    assert torch.equal(group_bytes(got[partly])[~moved], group_bytes(stored[partly])[~moved])
    assert torch.equal(bits(got[partly + SCALE])[~moved], bits(stored[partly + SCALE])[~moved])
    for name in set(stored) - {dense, dense + SCALE, expert, expert + SCALE, partly, partly + SCALE}:
        assert got[name].dtype == stored[name].dtype and torch.equal(bits(got[name]), bits(stored[name])), name

    run_merger("merge", "--local_dir", source, "--target_dir", tmp_path / "out-2", "--quantize_like", release,
               "--max_inflight", "16KiB", nproc=2)
    one, two = ((tmp_path / out / "model.safetensors").read_bytes() for out in ("out", "out-2"))
    assert one == two


def test_experts_stored_as_float4_e2m1fn_x2_are_read_and_written_back_as_such(deepseek_v4, tmp_path):
    """The same release with its experts stored as torch's float4_e2m1fn_x2 (safetensors' F4, whose header counts the
    codes) instead of int8: merger reads each expert as transformers' dequantizer reads the float4 tensor, and reads
    the rest as the int8 release's (transformers 5.24's loader itself fails on F4: it reshapes the bytes to the
    header's count of codes); written back like it, every byte is the release's, F4 included."""
    release, bf16 = deepseek_v4
    f4 = with_float4_experts(release, tmp_path / "release")
    stored = load_safetensors_folder(f4)
    experts = [n for n, t in stored.items() if t.dtype == torch.float4_e2m1fn_x2]
    with safe_open(f4 / "model.safetensors", "pt") as f:  # the premise: F4, a row of 256 codes in 128 bytes
        assert len(experts) == 24 and f.get_slice(experts[0]).get_dtype() == "F4"
        assert f.get_slice(experts[0]).get_shape() == [128, 256] and list(stored[experts[0]].shape) == [128, 128]
    read, plain = load_safetensors_folder(merge_in_process(f4, tmp_path / "bf16")), load_safetensors_folder(bf16)
    assert sorted(read) == sorted(plain) and all(torch.equal(bits(read[n]), bits(t)) for n, t in plain.items())
    for name in experts:
        want = Fp8Dequantize(SimpleNamespace())._dequantize_one(stored[name], stored[name + SCALE], torch.bfloat16)
        assert torch.equal(bits(read[name]), bits(want)), name
    assert sum(t.dtype == torch.float4_e2m1fn_x2 for t in written_back_like(f4, bf16, tmp_path / "back",
                                                                           "bfloat16").values()) == 24
