"""PEFT LoRA adapters as the merger sees them: which module each tensor changes, with which rank and scale.

Two spellings reach here, both reduced to the adapter-file form `<module>.lora_A.weight` (names relative to
the HF model, without `base_model.model.`): a saved adapter folder (`adapter_config.json` +
`adapter_model.safetensors` or legacy `.bin`), and the state dict of a PEFT-wrapped model in an FSDP checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from .fold import lora_scale, pattern_value

PEFT_PREFIX = "base_model.model."
# LoRA variants whose merge is not W + scale * B @ A (or DoRA): refused rather than folded wrongly.
_UNSUPPORTED = ("alora_invocation_tokens", "arrow_config", "kasa_config", "layer_replication", "megatron_config",
                "monteclora_config", "target_parameters", "trainable_token_indices", "use_bdlora", "use_qalora",
                "velora_config")
_LORA_PARTS = {"lora_A.weight": "a", "lora_B.weight": "b", "lora_B.bias": "b_bias",
               "lora_embedding_A": "a", "lora_embedding_B": "b", "lora_magnitude_vector": "magnitude"}


@dataclass
class ModuleAdapter:
    """One adapter on one module: the source tensor names of its parts and the scale PEFT gives it."""

    module: str
    a: str = ""
    b: str = ""
    b_bias: str | None = None
    magnitude: str | None = None
    embedding: bool = False
    r: int = 0
    alpha: float = 0.0
    scale: float = 0.0


@dataclass
class LoraAdapter:
    """An adapter: its config, its modules, and the base tensors it replaces (modules_to_save, saved
    embedding layers), each mapped to the source tensor that replaces it."""

    name: str
    config: dict
    modules: dict[str, ModuleAdapter] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)


def split_key(key: str) -> tuple[str, str] | None:
    """`<module>.lora_A.weight` -> (module, 'a'); None for a key that is no LoRA part."""
    for suffix, part in _LORA_PARTS.items():
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], part
    return None


def build_adapter(name: str, config: dict, keys: dict[str, str], shapes: dict[str, tuple]) -> LoraAdapter:
    """`keys` maps adapter-file-form names to source tensor names. Resolves each module's r and alpha as PEFT
    does (rank_pattern / alpha_pattern), and checks r against lora_A's shape."""
    adapter = LoraAdapter(name, config)
    for key, source in keys.items():
        if "token_adapter" in key or "trainable_tokens" in key:
            raise MergerError(f"trainable-token adapters are not supported, tensor {key} in {name}")
        split = split_key(key)
        if split is None:
            # modules_to_save copies and saved embedding layers (`<m>.base_layer.weight`) replace base tensors
            adapter.replacements[key.replace(".base_layer.", ".")] = source
            continue
        module, part = split
        m = adapter.modules.setdefault(module, ModuleAdapter(module))
        setattr(m, part, source)
        m.embedding = m.embedding or "lora_embedding_" in key
    for m in adapter.modules.values():
        if not m.a or not m.b:
            raise MergerError(f"module {m.module} has lora_{'B' if m.a else 'A'} but not lora_{'A' if m.a else 'B'}, "
                              f"{name}")
        m.r = int(pattern_value(config.get("rank_pattern") or {}, m.module, config["r"]))
        if shapes[m.a][0] != m.r:
            raise MergerError(f"tensor {m.a} has rank {shapes[m.a][0]} but the adapter config gives module "
                              f"{m.module} r={m.r}, {name}")
        m.alpha = float(pattern_value(config.get("alpha_pattern") or {}, m.module, config["lora_alpha"]))
        m.scale = lora_scale(m.alpha, m.r, bool(config.get("use_rslora")))
    return adapter


def read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise MergerError(f"no adapter_config.json in the adapter folder, {folder}") from e
    except (OSError, ValueError) as e:
        raise MergerError(f"cannot read adapter_config.json ({e}), {path}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise MergerError(f"adapter is {config.get('peft_type')}, merger merges LORA adapters, {path}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise MergerError(f"adapter_config.json has no positive {key}, {path}")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise MergerError(f"adapter uses {key}, a LoRA variant merger does not fold, {path}")
    return config


def open_adapter_catalog(folder: Path) -> Catalog:
    from ..sources.hf_safetensors import catalog_of_files
    from ..sources.torch_file import open_file_catalog

    if not folder.is_dir():
        raise MergerError(f"adapter folder does not exist, {folder}")
    if (folder / "adapter_model.safetensors").is_file():
        return catalog_of_files([folder / "adapter_model.safetensors"], folder, "peft_adapter")
    if (folder / "adapter_model.bin").is_file():
        return open_file_catalog(folder / "adapter_model.bin", "peft_adapter")
    raise MergerError(f"no adapter_model.safetensors or adapter_model.bin in the adapter folder, {folder}")


def adapter_from_folder(folder: Path, prefix: str, catalog: Catalog) -> LoraAdapter:
    """The adapter in `folder`, whose tensors are in the merge catalog under `prefix` + file key."""
    config = read_adapter_config(folder)
    keys = {}
    for key in catalog.tensors:
        if not key.startswith(PEFT_PREFIX):
            raise MergerError(f"adapter tensor {key} does not start with {PEFT_PREFIX}, {folder}")
        keys[key[len(PEFT_PREFIX):]] = prefix + key
    shapes = {prefix + k: t.shape for k, t in catalog.tensors.items()}
    return build_adapter(str(folder), config, keys, shapes)
