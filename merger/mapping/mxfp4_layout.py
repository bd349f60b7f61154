"""Which tensors a gpt-oss MXFP4 output quantizes: `--quantize mxfp4` (the experts, as the gpt-oss release
quantizes them) and `--quantize_like RELEASE` of a gpt-oss MXFP4 release (the tensors it stores as `_blocks` and
`_scales`, the others in its dtypes, its quantization_config). The format is described in mxfp4_quantize.py.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import MergerError
from ..hf_folder import read_config
from .fp8_release_layout import readable, release_headers
from .mxfp4_quantize import BLOCK, BLOCKS_SUFFIX, SCALES_SUFFIX, Mxfp4Output, packed_shapes
from .quantized_formats import MXFP4, QUANTIZATION_CONFIG

SCHEME = "mxfp4"
EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# what openai/gpt-oss-20b and -120b list in their quantization_config: everything but the experts
RELEASE_QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                          "model.embed_tokens", "lm_head"], "quant_method": MXFP4}


def _check_blocks(quantized: list[str], outputs: dict[str, tuple[int, ...]], where: Path) -> None:
    for name in quantized:
        shape = outputs[name]
        if len(shape) != 3 or shape[1] % BLOCK:
            raise MergerError(f"tensor {name} is {list(shape)}: MXFP4 stores an expert weight [experts, in, out] in "
                              f"blocks of {BLOCK} along `in`, which must be a multiple of {BLOCK} (transformers' "
                              f"dequantizer reads no partial block), {where}")


def default_layout(hf_dir: Path, config: dict, outputs: dict[str, tuple[int, ...]]) -> Mxfp4Output:
    """`--quantize mxfp4`: gpt-oss's expert weights, with the gpt-oss release's quantization_config."""
    where = hf_dir / "config.json"
    if config.get("model_type") != "gpt_oss":
        raise MergerError(f"--quantize {SCHEME} writes gpt-oss's MoE experts as the gpt-oss release stores them, and "
                          f"this model is {config.get('model_type')!r} (config.json's model_type), not gpt_oss, "
                          f"{where}")
    quantized = sorted(n for n in outputs if n.endswith(EXPERT_WEIGHTS))
    if not quantized:
        raise MergerError(f"--quantize {SCHEME}: the output has no gpt-oss expert weight (*{EXPERT_WEIGHTS[0]}, "
                          f"*{EXPERT_WEIGHTS[1]}), {where}")
    _check_blocks(quantized, outputs, where)
    return Mxfp4Output(frozenset(quantized), {}, dict(RELEASE_QUANTIZATION_CONFIG))


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]]) -> Mxfp4Output:
    """`--quantize_like` a gpt-oss MXFP4 release: how to write `outputs` (name -> shape) as it stores them."""
    tensors = release_headers(folder)
    quantized = sorted(name.removesuffix(BLOCKS_SUFFIX) for name in tensors
                       if name.endswith(BLOCKS_SUFFIX) and name.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX in tensors)
    here = [name for name in quantized if name in outputs]
    if not here:
        raise MergerError(f"no tensor of the output is stored as _blocks and _scales in the MXFP4 release "
                          f"({len(quantized)} quantized tensors, none of them here): --quantize_like needs the "
                          f"release of this model, {folder}")
    _check_blocks(here, outputs, folder)
    for name in here:
        want = packed_shapes(tuple(outputs[name]))
        stored = (tensors[name + BLOCKS_SUFFIX].shape, tensors[name + SCALES_SUFFIX].shape)
        if want != stored:
            raise MergerError(f"tensor {name} is {list(outputs[name])} here, which MXFP4 stores as {list(want[0])} "
                              f"blocks, but the release has {list(stored[0])}: --quantize_like needs the release of "
                              f"this model, {folder}")
    packed = {n + suffix for n in quantized for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
    dtypes = {name: t.dtype for name, t in tensors.items() if name not in packed and t.dtype.is_floating_point}
    return Mxfp4Output(frozenset(here), dtypes, read_config(folder)[QUANTIZATION_CONFIG], readable(tensors))
