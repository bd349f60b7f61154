"""Which compressed-tensors releases merger reads: the formats, the one scheme of each it reads, and the parts a
quantized weight of each is stored as (FORMATS.md, "Quantized release formats of 2026"; compressed-tensors 0.20's
compressors).

config.json says `quant_method: "compressed-tensors"`, the `format` the files are in, and per config group the
weights' quantization arguments. merger reads a format only with the arguments its arithmetic
(compressed_tensors_codec.py) assumes, in every group: another group size, zero points (asymmetric), activation
reordering, weights without stored scales, rotations (transform_config), sparsity or quantized KV-cache scales
would be read wrong, so they are refused, named. Which tensors are quantized is read off the files (a weight's
parts beside it), as compressed-tensors' own dequantizer does, not off the groups' targets.
"""
from __future__ import annotations

COMPRESSED_TENSORS = "compressed-tensors"  # the quant_method
# format -> (the weights' quantization arguments merger reads it with, the parts its files store a quantized weight
# `<module>.weight` as; NVFP4's `input_global_scale` is the activations' calibration, not part of the weight)
READ = {
    "nvfp4-pack-quantized": (dict(num_bits=4, type="float", strategy="tensor_group", group_size=16),
                             ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")),
    "pack-quantized": (dict(num_bits=4, type="int", strategy="group", group_size=32),
                       ("weight_packed", "weight_scale", "weight_shape")),
    "mxfp4-pack-quantized": (dict(num_bits=4, type="float", strategy="group", group_size=32),
                             ("weight_packed", "weight_scale")),
    "mxfp8-quantized": (dict(num_bits=8, type="float", strategy="group", group_size=32), ("weight_scale",)),
}
# what every format is read with, each compressed-tensors' default when config.json leaves it out: no zero point,
# scales stored in the files, columns in their order, no blocks
COMMON = dict(symmetric=True, dynamic=False, actorder=None, block_structure=None)
# the keys of a quantization_config that change what the stored weights are or add tensors that are not weights
UNREAD_KEYS = ("sparsity_config", "transform_config", "kv_cache_scheme")


def unread(qc: dict) -> str | None:
    """What weights a compressed-tensors quantization_config describes that merger does not read (None: it reads
    them all)."""
    fmt = qc.get("format")
    if fmt not in READ:
        return f"{COMPRESSED_TENSORS} {fmt or 'quantized'} weights"  # mixed-precision: groups differ
    for key in UNREAD_KEYS:
        if qc.get(key):
            return f"{COMPRESSED_TENSORS} {fmt} weights with a {key}"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return f"{COMPRESSED_TENSORS} {fmt} weights with no config_groups"
    want = {**READ[fmt][0], **COMMON}
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict) or group.get("format") not in (None, fmt):
            return f"{COMPRESSED_TENSORS} {fmt} weights whose config group {name} is another format"
        if group.get("output_activations"):
            return f"{COMPRESSED_TENSORS} {fmt} weights whose config group {name} quantizes output activations"
        differ = [f"{key}={weights.get(key, COMMON.get(key))}" for key, value in want.items()
                  if weights.get(key, COMMON.get(key)) != value]
        if differ:
            return f"{COMPRESSED_TENSORS} {fmt} weights with {', '.join(differ)} in config group {name}"
    return None


def stored_parts(qc: dict) -> tuple[str, ...]:
    """The parts a read release's files store its quantized weights as."""
    return READ[qc["format"]][1]
