"""`--quantize nvfp4` and `--quantize int4`: compressed-tensors output for a model with no release, as llmcompressor
saves one (its `oneshot`, whose `save_pretrained` has compressed-tensors' `ModelCompressor` write the weights and
config.json's quantization_config).

- nvfp4 (llmcompressor's NVFP4A16: weights only, `nvfp4-pack-quantized`): every Linear layer transformers would
  quantize by default (fp8_default_modules.py asks transformers itself: every plain `nn.Linear` and each expert
  of an `experts` module; not `lm_head`; embeddings, norms and routers are no Linear layers), each 2-dim weight as
  `weight_packed`, `weight_scale` per 16 and `weight_global_scale`, by compressed-tensors' rule
  (nvfp4_release_layout.py). The global scale is shared as oneshot shares it (llmcompressor 0.14's
  FUSED_LAYER_NAMES: q/k/v, each gate/up, dense or expert, DeepSeek's q_a_proj/kv_a_proj_with_mqa, w1/w3): the
  layers vLLM fuses into one must have one global scale. model_free_ptq shares fewer (not an expert's gate/up).
- int4 (Kimi-K2-Thinking's scheme, `pack-quantized`, symmetric in groups of 32): the routed experts only (the
  weights of transformers' `experts` modules), by compressed-tensors' rule (int4_release_layout.py), the scales in
  the model's dtype; every other Linear layer stays at --dtype and is listed in `ignore`, as Kimi's release lists
  them.

A weight that is not whole groups stays at --dtype, its module in `ignore`: a reader's kernels take whole groups
(llmcompressor's model_free_ptq refuses such a weight), and the log and `inspect` name it. A weight of more than
two dims (experts stored fused, [E, out, in]) is no Linear layer compressed-tensors stores: it stays too. An experts
module with one such weight stays whole: transformers and vLLM read all of a layer's experts in one scheme
(transformers 5.24, given a tiny DeepSeek-V3 whose experts' gate/up were INT4 and down_proj bfloat16, left
down_proj uninitialised, with a warning only).

`ignore` lists the Linear layers left unquantized, as compressed-tensors' `QuantizationConfig.from_pretrained` lists
them (each unquantized module of a type it quantizes), under their saved names; the config is the one
`ModelCompressor.update_config` writes, its `version` the compressed-tensors release whose format this is.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MergerError
from .fp8_default_modules import default_weights
from .int4_release_layout import GROUP as INT4_GROUP, PACK_QUANTIZED, Int4Output
from .nvfp4_release_layout import GROUP as NVFP4_GROUP, NVFP4_PACK_QUANTIZED, ONESHOT_FUSED, Nvfp4Output, shared_groups

SCHEMES = ("nvfp4", "int4")
COMPRESSED_TENSORS_VERSION = "0.20.0"  # the version whose ModelCompressor writes this config
# what compressed-tensors writes for each scheme's weights (QuantizationArgs.model_dump, its defaults left out)
WEIGHTS = {"nvfp4": {"dynamic": False, "group_size": NVFP4_GROUP, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
                     "strategy": "tensor_group", "symmetric": True, "type": "float"},
           "int4": {"dynamic": False, "group_size": INT4_GROUP, "num_bits": 4, "strategy": "group", "symmetric": True,
                    "type": "int"}}
FORMATS = {"nvfp4": NVFP4_PACK_QUANTIZED, "int4": PACK_QUANTIZED}
GROUPS = {"nvfp4": NVFP4_GROUP, "int4": INT4_GROUP}


def quantization_config(name: str, ignore: list[str]) -> dict:
    """config.json's quantization_config, as compressed-tensors 0.20's ModelCompressor writes it."""
    fmt = FORMATS[name]
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": dict(WEIGHTS[name])}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "moe_sparsity_config": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION}


def _module(weight: str) -> str:
    return weight.removesuffix(".weight")


def default_layout(hf_dir: Path, config: dict, outputs: dict[str, tuple[int, ...]], trust_remote_code: bool,
                   name: str, dtype: torch.dtype | None) -> tuple[Nvfp4Output | Int4Output, list[str], list[str]]:
    """How to write `outputs` in scheme `name` (SCHEMES), the module patterns transformers skips, and the weights
    left unquantized for not being whole groups (or not 2-dim; an experts module's every weight, if one is not)."""
    chosen, skip = default_weights(hf_dir, config, outputs, trust_remote_code, name)
    candidates = {m: ws for m, ws in chosen.items() if name != "int4" or m.endswith(".experts")}
    if name == "int4" and not candidates:  # the routed experts: the weights of transformers' experts modules
        raise MergerError(f"--quantize int4 writes the routed experts (Kimi-K2's scheme), and this model has none "
                          f"(model_type {config.get('model_type')!r}), {hf_dir / 'config.json'}")
    group = GROUPS[name]
    # an experts module is quantized whole or not at all: transformers and vLLM take one scheme for all its experts
    partial = {m for m, ws in candidates.items() if not all(len(outputs[w]) == 2 and not outputs[w][-1] % group
                                                            for w in ws)}
    quantized = frozenset(w for m, ws in candidates.items() if m not in partial for w in ws)
    weights = sorted(w for ws in chosen.values() for w in ws)
    ignore = skip + [_module(w) for w in weights if w not in quantized]
    qc = quantization_config(name, ignore)
    left = sorted(w for m in partial for w in candidates[m])
    if name == "nvfp4":
        return Nvfp4Output(quantized, {}, qc, shared=shared_groups(quantized, None, "", ONESHOT_FUSED)), skip, left
    return Int4Output(quantized, {}, qc, dtype or torch.bfloat16), skip, left
