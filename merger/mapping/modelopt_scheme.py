"""Which ModelOpt exports merger reads: the `quant_algo`s, the group size of each, the parts its files store a
quantized weight as (FORMATS.md, "Quantized release formats of 2026"; nvidia-modelopt 0.47's
`export_hf_checkpoint`).

ModelOpt describes its export in `hf_quant_config.json` beside config.json (`{"producer": {"name": "modelopt"},
"quantization": {"quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules"}}`) and, since 0.2x, the same
in config.json's `quantization_config` (`quant_method: "modelopt"`, `quant_algo`, `config_groups` whose weights give
the group size, `ignore` = exclude_modules, `kv_cache_scheme`). merger reads whichever is there; where both are,
they must agree. It reads NVFP4 (groups of 16) and MXFP8 (groups of 32), with the KV cache unquantized or FP8 (its
`k_scale` and `v_scale` are the attention's calibration, no weight: left out, named in the note). Every other
algorithm (FP8, INT4_AWQ, W4A8_AWQ, NVFP4_AWQ, MIXED_PRECISION, ...) would be read wrong, so it is refused, named.
"""
from __future__ import annotations

import json
from pathlib import Path

MODELOPT = "modelopt"  # config.json's quant_method
MODELOPT_CONFIG = "hf_quant_config.json"  # ModelOpt's own description of its export, beside config.json
# quant_algo -> (its group size, the parts its files store a quantized weight `<module>.weight` as besides the
# weight itself: NVFP4's weight is uint8 e2m1 pairs, MXFP8's float8; `input_scale` is the activations' calibration)
READ = {"NVFP4": (16, ("weight_scale", "weight_scale_2", "input_scale")),
        "MXFP8": (32, ("weight_scale", "input_scale"))}
KV_CACHE_READ = (None, "FP8")  # the KV-cache quantizations whose tensors are known: per-tensor k_scale, v_scale
KV_SCALES = ("k_scale", "v_scale")


def is_modelopt(folder: Path, config: dict) -> bool:
    """Whether `folder` holds a ModelOpt export: its hf_quant_config.json, or config.json saying modelopt."""
    qc = config.get("quantization_config")
    return (folder / MODELOPT_CONFIG).is_file() or (isinstance(qc, dict) and qc.get("quant_method") == MODELOPT)


def _from_file(path: Path) -> dict | None:
    """hf_quant_config.json's `quantization`, or None where unreadable or malformed."""
    try:
        quantization = json.loads(path.read_text()).get("quantization")
    except (OSError, ValueError, AttributeError):
        return None
    return quantization if isinstance(quantization, dict) else None


def _from_config(qc: dict) -> dict:
    """config.json's quantization_config said as hf_quant_config.json says it."""
    groups = qc.get("config_groups")
    group = next(iter(groups.values()), None) if isinstance(groups, dict) and len(groups) == 1 else None
    weights = group.get("weights") if isinstance(group, dict) else None
    kv = qc.get("kv_cache_scheme")
    if isinstance(kv, dict):  # ModelOpt writes FP8's as its compressed-tensors arguments
        kv = "FP8" if (kv.get("num_bits"), kv.get("type")) == (8, "float") else str(kv)
    return {"quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": kv or None,
            "group_size": weights.get("group_size") if isinstance(weights, dict) else None,
            "exclude_modules": qc.get("ignore")}


def described(folder: Path, config: dict) -> tuple[dict | None, str | None, Path]:
    """(ModelOpt's description of the export as hf_quant_config.json words it, or None where it cannot be read;
    what merger does not read in it, or None; the file that says it)."""
    path, qc = folder / MODELOPT_CONFIG, config.get("quantization_config")
    ours = _from_config(qc) if isinstance(qc, dict) and qc.get("quant_method") == MODELOPT else None
    if not path.is_file():
        path = folder / "config.json"
        desc = ours
    else:
        desc = _from_file(path)
        if desc is None:
            return None, f"ModelOpt quantized weights ({MODELOPT_CONFIG} unreadable)", path
        if ours is not None:
            differ = [key for key in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
                      if ours[key] is not None and ours[key] != desc.get(key)]
            if differ:
                return desc, (f"ModelOpt weights whose {MODELOPT_CONFIG} and config.json's quantization_config "
                              f"disagree on {', '.join(differ)}"), path
    return desc, unread(desc, MODELOPT_CONFIG if path.name == MODELOPT_CONFIG else
                        "config.json's quantization_config"), path


def unread(desc: dict, where: str) -> str | None:
    """What weights ModelOpt's description `desc` (from file `where`) gives that merger does not read (None: it
    reads them all)."""
    algo = desc.get("quant_algo")
    name = f"ModelOpt {algo if isinstance(algo, str) else 'quantized'} weights"
    if not isinstance(algo, str) or algo not in READ:
        return f"{name} ({where})"
    if desc.get("group_size") not in (None, READ[algo][0]):  # none said: the algorithm's own, as ModelOpt reads it
        return f"{name} in groups of {desc.get('group_size')}, not {READ[algo][0]} ({where})"
    if desc.get("kv_cache_quant_algo") not in KV_CACHE_READ:
        return f"{name} with kv_cache_quant_algo {desc.get('kv_cache_quant_algo')} ({where})"
    excluded = desc.get("exclude_modules")
    if excluded is not None and not (isinstance(excluded, list) and all(isinstance(e, str) for e in excluded)):
        return f"{name} with exclude_modules {excluded!r}, not a list of names ({where})"
    return None
