"""A DeepSeek-V4 release read: FP8 weights in 128x128 blocks and FP4 routed experts (e2m1 pairs in int8, blocks of
1x32), every scale float8_e8m0fnu (#49 item 1). The release is transformers' own `deepseek_v4` model as
save_pretrained names it, stored as DeepSeek ships V4 (tests/writers/deepseek_v4_release.py). The oracle is
transformers: its loader dequantizes the release on CPU (`Fp8Dequantize`), and the model it loads from merger's
output must hold the same bits in every parameter. It is written back by `--quantize_like`
(test_deepseek_v4_write.py), and a LoRA folded into it by `merger lora` (test_lora_deepseek_v4.py).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.helpers.release_bytes import bits
from tests.writers.deepseek_v4_release import SCALE

pytestmark = pytest.mark.slow


def _parameters(folder) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()


def test_every_parameter_is_transformers_dequantization_of_the_release(deepseek_v4):
    release, out = deepseek_v4
    with safe_open(release / "model.safetensors", "pt") as f:  # the premise: both kinds, the experts FP4
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert {"F8_E4M3", "I8", "F8_E8M0"} <= set(dtypes.values())
    assert all(dtypes[n] == "I8" for n in dtypes if ".ffn.experts." in n and not n.endswith(SCALE))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v4"
    want, got = _parameters(release), _parameters(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(bits(got[name]), bits(tensor)), name

