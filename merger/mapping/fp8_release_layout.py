"""`--quantize_like RELEASE`: the output written in the layout of a base model's FP8 block-scaled release.

What is read of the release here is its config.json (`quantization_config`: quant_method fp8 with
weight_block_size, `scale_fmt`) and its safetensors headers: the tensors that have a `<name>_scale_inv` are the
ones quantized, every other tensor takes the dtype the release stores it in. Where each quantized tensor is
written, its codes and scales are read from the release (release_blocks.py: unchanged blocks keep their bytes). The
scales are written float32, or as e8m0 where the release stores them so (`scale_fmt: "ue8m0"`): bytes (uint8) as
transformers' `mxfp8` stores them, float8_e8m0fnu as DeepSeek-V4's. DeepSeek-V4's routed experts (`expert_dtype:
"fp4"`, stored as FP4 pairs: int8 or float4_e2m1fn_x2) are written in FP4 as the release has them
(fp4_experts_quantize.py). A local folder's headers are read from its files; a Hub snapshot (mapping/hub_folders.py
fetches only its config files) has its headers read from the Hub by huggingface_hub's `get_safetensors_metadata`
(ranged reads of each file's first bytes).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MergerError
from ..hf_folder import read_config, weight_files
from ..safetensors_io import DTYPES_BY_NAME, read_header, tensor_shape
from .fp8 import E8M0_BYTES, FP4_STORED, block_size, ue8m0_scales, weight_block
from .fp8_quantize import FP8, SCALE_DTYPE, Fp8Output
from .hub_folders import hub_id_of
from .release_blocks import StoredTensor
from .quantized_formats import QUANTIZATION_CONFIG, SCALE_SUFFIX, fp4_experts, fp8_block_config

FLAG = "--quantize_like"
E8M0_SCALES = frozenset({E8M0_BYTES, torch.float8_e8m0fnu})  # a power-of-two scale stored as its exponent


def _local_headers(folder: Path) -> dict[str, StoredTensor]:
    tensors = {}
    for file in weight_files(folder):
        if not file.name.endswith(".safetensors"):
            raise MergerError(f"{FLAG} reads safetensors releases; this one has {file.name}, {folder}")
        start, entries, _ = read_header(str(file))
        tensors.update({name: StoredTensor(e.dtype, e.shape, str(file), start + e.begin) for name, e in entries.items()})
    return tensors


def _hub_headers(repo_id: str, revision: str, folder: Path) -> dict[str, StoredTensor]:
    from huggingface_hub import get_safetensors_metadata

    try:
        metadata = get_safetensors_metadata(repo_id, revision=revision)
    except Exception as e:  # noqa: BLE001 - offline, gated, no safetensors: one line, not a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        raise MergerError(f"{FLAG}: cannot read the safetensors headers of Hub model {repo_id} "
                          f"({type(e).__name__}: {first}), {folder}") from e
    tensors = {}
    for file, meta in metadata.files_metadata.items():
        for name, info in meta.tensors.items():
            dtype = DTYPES_BY_NAME.get(info.dtype)
            shape = tensor_shape(tuple(info.shape), dtype) if dtype is not None else None
            if shape is None:
                raise MergerError(f"{FLAG}: tensor {name} of Hub model {repo_id} is stored as {info.dtype} "
                                  f"{list(info.shape)}, which merger does not write, {file}")
            tensors[name] = StoredTensor(dtype, shape)  # no bytes here
    return tensors


def quantized_here(quantized: frozenset[str], outputs: dict[str, tuple[int, ...]], folder: Path) -> frozenset:
    """The outputs that the release in `folder` quantizes (`quantized`: its quantized weights by name); none at all
    means the release is another model's, which is refused."""
    here = quantized & outputs.keys()
    if not here:
        raise MergerError(f"no tensor of the output is quantized in the release ({len(quantized)} quantized tensors, "
                          f"none of them here): {FLAG} needs the release of this model, {folder}")
    return here


def packed_release(folder: Path, outputs: dict[str, tuple[int, ...]], parts: tuple[str, ...], per_code: int,
                   group: int) -> tuple[dict[str, StoredTensor], frozenset[str], dict[str, torch.dtype]]:
    """A compressed-tensors release that stores each quantized weight `<m>.weight` [out, in] as its `parts` (the
    first holds the codes, [out, in / per_code]; the second the scales, a group of `group` elements each): the
    release's tensors, the weights of `outputs` it quantizes, and the dtypes it stores its other floating point
    tensors in. A weight shaped otherwise here, or not in whole groups, is refused."""
    tensors = release_headers(folder)
    codes, scales = parts[0], parts[1]
    quantized = {name.removesuffix(codes): t for name, t in tensors.items()
                 if name.endswith(codes) and name.removesuffix(codes) + scales in tensors}
    here = quantized_here(frozenset(quantized), outputs, folder)
    for name in sorted(here):
        rows, units = quantized[name].shape
        if tuple(outputs[name]) != (rows, units * per_code) or outputs[name][1] % group:
            raise MergerError(f"tensor {name} is {list(outputs[name])} here but {[rows, units * per_code]} in the "
                              f"release: {FLAG} needs the release of this model, {folder}")
    stored = {name + part for name in quantized for part in parts}
    dtypes = {name: t.dtype for name, t in tensors.items() if name not in stored and t.dtype.is_floating_point}
    return tensors, here, dtypes


def release_headers(folder: Path) -> dict[str, StoredTensor]:
    """The release's tensors by name; a Hub id's (whose weights are not fetched) without where their bytes are."""
    repo_id = hub_id_of(folder)
    if repo_id is not None and not any(folder.glob("*.safetensors")):
        return _hub_headers(repo_id, folder.name, folder)
    tensors = _local_headers(folder)
    if not tensors:
        raise MergerError(f"{FLAG} names a folder with no safetensors weights (their headers say which tensors "
                          f"are quantized), {folder}")
    return tensors


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]]) -> Fp8Output:
    """How to write `outputs` (name -> shape) as the release in `folder` stores them (DeepSeek-V4's: its experts
    FP4, where its config says `expert_dtype: fp4` and the release stores them as FP4 pairs)."""
    config = read_config(folder)
    qc = fp8_block_config(config)
    if qc is None:
        raise MergerError(f"{FLAG} needs an FP8 block-scaled release: its config.json's {QUANTIZATION_CONFIG} must "
                          f"say quant_method fp8 with a weight_block_size, {folder / 'config.json'}")
    block = block_size(qc, folder / "config.json")
    tensors = release_headers(folder)
    quantized = frozenset(name for name in tensors if name + SCALE_SUFFIX in tensors)
    fp4 = frozenset(name for name in quantized if fp4_experts(qc) and tensors[name].dtype in FP4_STORED)
    for name in sorted(quantized & outputs.keys()):
        shape = weight_block(tensors[name], block)[0] if name in fp4 else tensors[name].shape
        if tuple(outputs[name]) != shape:
            raise MergerError(f"tensor {name} is {list(outputs[name])} here but {list(shape)} in the "
                              f"release: {FLAG} needs the release of this model, {folder}")
    if not quantized & outputs.keys():
        raise MergerError(f"no tensor of the output has a scale in the release ({len(quantized)} quantized tensors, "
                          f"none of them here): {FLAG} needs the release of this model, {folder}")
    dtypes = {name: t.dtype for name, t in tensors.items()
              if name not in quantized and t.dtype.is_floating_point and t.dtype != FP8
              and not name.endswith(SCALE_SUFFIX)}
    scale_dtypes = {tensors[name + SCALE_SUFFIX].dtype for name in quantized}
    e8m0 = scale_dtypes & E8M0_SCALES
    if e8m0 and (len(scale_dtypes) > 1 or not ue8m0_scales(qc)):
        stored = ", ".join(sorted(str(d).removeprefix("torch.") for d in scale_dtypes))
        raise MergerError(f"the release stores its scales as {stored} with scale_fmt {qc.get('scale_fmt')!r}: "
                          f"{FLAG} writes e8m0 scales (uint8 or float8_e8m0fnu) only where every scale is one and "
                          f"scale_fmt is 'ue8m0', {folder}")
    pairs = {tensors[name].dtype for name in fp4}  # int8, or float4_e2m1fn_x2: the same bytes
    if len(pairs) > 1:
        raise MergerError(f"the release stores its FP4 experts both as int8 and as float4_e2m1fn_x2: {FLAG} writes "
                          f"them in one dtype, {folder}")
    return Fp8Output(block, ue8m0_scales(qc), quantized, dtypes, qc, next(iter(e8m0), SCALE_DTYPE),
                     readable(tensors), fp4, *pairs)


def readable(tensors: dict[str, StoredTensor]) -> dict[str, StoredTensor] | None:
    """The release's tensors where their bytes can be read (a folder, a bucket), None for a Hub id's."""
    return tensors if all(t.file is not None for t in tensors.values()) else None
