"""Which quantized format a HF folder's weights are stored in, decided here for every command that reads one: a
merge of the folder (or of any checkpoint under HF names), a LoRA base, `--quantize_like`'s release.

merger handles four: FP8 block-scaled releases (`quant_method: "fp8"` with a `weight_block_size`, dequantized by
fp8.py, written by fp8_quantize.py; DeepSeek-V4's, whose routed experts are FP4 (`expert_dtype: "fp4"`,
fp4_experts_quantize.py), too),
gpt-oss's MXFP4 experts (`quant_method: "mxfp4"`, written by mxfp4_quantize.py; as a source its `_blocks` and
`_scales` are kept as stored, with the quantization_config that says what they are), compressed-tensors releases in
`nvfp4-pack-quantized`, INT4 `pack-quantized`, `mxfp4-pack-quantized` or `mxfp8-quantized` with the scheme
compressed_tensors_scheme.py names, and ModelOpt's NVFP4 and MXFP8 exports (`hf_quant_config.json`,
modelopt_scheme.py). The last two are read, dequantized by compressed_tensors.py and modelopt.py, and written back by
`--quantize_like` (mxfp8_release_layout.py, int4_release_layout.py, mxfp4_pack_release_layout.py,
nvfp4_release_layout.py), and a LoRA is folded into them (lora/quantized_base.py). Every other format is refused with one line naming it and the file that says it: compressed-tensors' other formats and
schemes (`mxfp6-pack-quantized`, zero points, other group sizes, ...), ModelOpt's other algorithms (FP8, INT4_AWQ,
W4A8_AWQ, NVFP4_AWQ, mixed precision, ...), transformers' `mxfp8` in other blocks, FP8 with experts in another
`expert_dtype`, FP8 without blocks, GPTQ, AWQ, bitsandbytes and any other `quant_method`. Merged as plain tensors,
their packed weights and scales would be written as if they were weights: a model that loads wrong or not at all,
with exit 0. A tensor named as such a format names a weight's part (`weight_packed`, `weight_scale`, ...) in a
folder whose config does not describe that part is refused too: without the config, nothing says how to read it.

transformers' `mxfp8` (`quant_method: "mxfp8"`, `weight_block_size: [1, 32]`, `scale_fmt: "ue8m0"`, its scales
stored as e8m0 bytes) is FP8 block-scaled: read by fp8.py and written by fp8_quantize.py as such.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

from ..catalog import SourceTensor
from ..errors import MergerError
from . import modelopt_scheme
from .compressed_tensors_scheme import COMPRESSED_TENSORS, READ, stored_parts, unread
from .modelopt_scheme import MODELOPT
from .mxfp4_quantize import BLOCKS_SUFFIX, SCALES_SUFFIX

QUANTIZATION_CONFIG = "quantization_config"
FP8_BLOCK = "fp8"  # the quant_method values merger handles, as the formats' names
MXFP4 = "mxfp4"
# transformers' MXFP8 (FineGrainedFP8Config): FP8 blocks in the one scheme transformers writes, read as FP8_BLOCK
MXFP8 = "mxfp8"
MXFP8_SCHEME = {"weight_block_size": [1, 32], "scale_fmt": "ue8m0"}
HANDLED = ("a quantized format merger does not handle: it reads and writes FP8 block-scaled releases (quant_method "
           "fp8 with weight_block_size, or mxfp8 in blocks of 1x32 with scale_fmt ue8m0) and gpt-oss MXFP4 "
           "(quant_method mxfp4), and reads compressed-tensors "
           f"{', '.join(READ)} (symmetric, in groups of 16 for NVFP4 and of 32 for the others) and ModelOpt "
           f"{' and '.join(f'{algo} (groups of {group})' for algo, (group, _) in modelopt_scheme.READ.items())}, "
           f"and writes compressed-tensors' mxfp8-quantized, pack-quantized, mxfp4-pack-quantized and "
           f"nvfp4-pack-quantized and ModelOpt's "
           f"MXFP8 back with --quantize_like")
# The last part of a name that compressed-tensors, ModelOpt and FP8 releases give a quantized weight's pieces
# (FORMATS.md, "Quantized release formats of 2026"); exact names, since plain models have `layer_scale_2` and such.
PACKED_PARTS = frozenset({"weight_packed", "weight_scale", "weight_shape", "weight_global_scale",
                          "weight_zero_point", "weight_scale_2", "input_scale", "input_global_scale"})
SCALE_SUFFIX = "_scale_inv"  # FP8's scale of `<name>`: `weight_scale_inv`, a fused expert's `gate_up_proj_scale_inv`
# what each handled format calls itself in a message, and the packed parts it stores
DESCRIBED = {FP8_BLOCK: ("FP8 block-scaled", (SCALE_SUFFIX,)), MXFP4: ("gpt-oss MXFP4", (BLOCKS_SUFFIX, SCALES_SUFFIX))}


def fp4_experts(qc: dict) -> bool:
    """Whether an FP8 block-scaled config stores its experts as FP4 (DeepSeek-V4's `expert_dtype: "fp4"`)."""
    return qc.get("expert_dtype") == "fp4"


def _is_fp8_block(qc: object) -> bool:
    """A quantization_config of FP8 block scaling: quant_method fp8 with blocks, or mxfp8 in MXFP8_SCHEME; its experts
    FP8 too (transformers' own config says `expert_dtype: "fp8"`), or FP4 as DeepSeek-V4's (quant_method fp8 only)."""
    if not isinstance(qc, dict) or qc.get("expert_dtype") not in (None, "fp8", "fp4"):
        return False
    if fp4_experts(qc) and qc.get("quant_method") != FP8_BLOCK:
        return False
    if qc.get("quant_method") == MXFP8:
        return all(qc.get(key) == value for key, value in MXFP8_SCHEME.items())
    return qc.get("quant_method") == FP8_BLOCK and qc.get("weight_block_size") is not None


def fp8_block_config(config: dict) -> dict | None:
    """config.json's quantization_config when it names FP8 block scaling (DeepSeek-V4's FP4 experts included), else
    None."""
    qc = config.get(QUANTIZATION_CONFIG)
    return qc if _is_fp8_block(qc) else None


def _unhandled(qc: object) -> str | None:
    """What the weights a quantization_config merger does not handle describes are called (None: it handles it)."""
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        return "weights quantized with no quant_method"
    method = qc["quant_method"]
    if method == MXFP4 or _is_fp8_block(qc):
        return None
    if method == COMPRESSED_TENSORS:
        return unread(qc)
    if method == FP8_BLOCK and qc.get("weight_block_size") is not None:
        return f"FP8 weights with {qc.get('expert_dtype')} experts"
    if method == FP8_BLOCK:
        return "FP8 weights scaled per tensor or per channel, without weight_block_size"
    if method == MXFP8:
        found = ", ".join(f"{key} {qc.get(key)!r}" for key in (*MXFP8_SCHEME, "expert_dtype") if key in qc)
        return f"transformers' mxfp8 weights ({found or 'no weight_block_size nor scale_fmt'})"
    return f"quant_method {method!r} weights"


def config_format(folder: Path, config: dict) -> str | None:
    """The quantized format `folder`'s config.json (`config`) says its weights are in: FP8_BLOCK, MXFP4,
    COMPRESSED_TENSORS (a format and scheme merger reads), MODELOPT (an algorithm merger reads), or None (not
    quantized); any other is refused, naming the file that says it."""
    if modelopt_scheme.is_modelopt(folder, config):
        _, what, path = modelopt_scheme.described(folder, config)
        if what is not None:
            raise MergerError(f"{what}, {HANDLED}, {path}")
        return MODELOPT
    if config.get(QUANTIZATION_CONFIG) is None:
        return None
    what = _unhandled(config[QUANTIZATION_CONFIG])
    if what is not None:
        raise MergerError(f"{what} (config.json's {QUANTIZATION_CONFIG}), {HANDLED}, {folder / 'config.json'}")
    qc = config[QUANTIZATION_CONFIG]
    return FP8_BLOCK if _is_fp8_block(qc) else COMPRESSED_TENSORS if qc["quant_method"] == COMPRESSED_TENSORS else MXFP4


def _described(found: str | None, folder: Path, config: dict) -> tuple[str | None, tuple[str, ...]]:
    """What format `found` (config_format's answer) calls itself in a message, and the packed parts it stores."""
    if found == COMPRESSED_TENSORS:
        qc = config[QUANTIZATION_CONFIG]
        return f"{COMPRESSED_TENSORS} {qc['format']}", stored_parts(qc)
    if found == MODELOPT:
        algo = modelopt_scheme.described(folder, config)[0]["quant_algo"]
        return f"ModelOpt {algo}", modelopt_scheme.READ[algo][1]
    return DESCRIBED.get(found, (None, ()))


def _packed_part(name: str, names: Collection[str]) -> str | None:
    """The quantized-weight part `name` is (`weight_packed`, `_scale_inv`, `_blocks`, ...), else None."""
    part = name.rsplit(".", 1)[-1]
    if part in PACKED_PARTS:
        return part
    if part.endswith(SCALE_SUFFIX):
        return SCALE_SUFFIX
    for suffix, pair in ((BLOCKS_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCKS_SUFFIX)):  # gpt-oss's pair
        if part.endswith(suffix) and name.removesuffix(suffix) + pair in names:
            return suffix
    return None


def stored_format(folder: Path, config: dict, tensors: dict[str, SourceTensor]) -> str | None:
    """config_format of the folder whose config describes `tensors`, every packed part among them checked to be
    one that format stores (FP8's `_scale_inv`, MXFP4's `_blocks` and `_scales`, compressed-tensors' format's own):
    another is no weight to write."""
    found = config_format(folder, config)
    described, parts = _described(found, folder, config)
    for name, tensor in tensors.items():
        part = _packed_part(name, tensors)
        if part is not None and part not in parts:
            said = f"its {QUANTIZATION_CONFIG} says {described}" if described else f"it has no {QUANTIZATION_CONFIG}"
            raise MergerError(f"tensor {name} is part of a quantized weight ({part}) that config.json does not "
                              f"describe ({said}): merger does not write a packed tensor as a weight, "
                              f"{tensor.file}")
    return found


def unquantized_note(cast_sources: Collection[str]) -> str:
    """The log's and `inspect`'s line naming the tensors a quantized release stores unquantized (`cast_sources`, the
    release's names: cast to --dtype, not dequantized), each layer's index as `*` so the line stays one per kind of
    tensor: a user sees what the release left out of its format (lm_head, norms, an `ignore` list) at a glance."""
    kinds = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in cast_sources)
    return f"merger: unquantized in the release: {len(cast_sources)} tensors ({', '.join(kinds)}), cast to --dtype"


def describes_none_of(config: dict, written: Collection[str]) -> bool:
    """Whether config.json has a quantization_config although none of the tensors `written` is part of a quantized
    weight: a bf16 model whose config came from a release (a Megatron or torchtitan checkpoint merged with
    `--hf_model_config_path` of an FP8 release's folder). Left in, it would make transformers load the plain
    weights as that format, looking for scales that are not there."""
    return config.get(QUANTIZATION_CONFIG) is not None and not any(_packed_part(n, written) for n in written)
