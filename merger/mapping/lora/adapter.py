"""PEFT LoRA adapters as the merger sees them: which module each tensor changes, with which rank and scale.

Two spellings reach here, both reduced to the adapter-file form `<module>.lora_A.weight` (names relative to
the HF model, without `base_model.model.`): a saved adapter folder (`adapter_config.json` +
`adapter_model.safetensors` or legacy `.bin`), and the state dict of a PEFT-wrapped model in an FSDP checkpoint.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ...catalog import Catalog, SourceTensor
from ...errors import MergerError
from ...sources.peft_adapter import CONFIG_FILE
from ..steps import Step, cast
from .expert_params import ParamLora, wrapped_parameter
from .fold import lora_scale, pattern_value

PEFT_PREFIX = "base_model.model."
# transformers models built on Conv1D, whose weights are stored [in, out] (PEFT's fan_in_fan_out)
_CONV1D_MODELS = {"gpt2", "openai-gpt", "imagegpt", "decision_transformer"}
# LoRA variants whose merge is not W + scale * B @ A (or DoRA): refused rather than folded wrongly.
_UNSUPPORTED = ("alora_invocation_tokens", "arrow_config", "kasa_config", "layer_replication", "megatron_config",
                "monteclora_config", "trainable_token_indices", "use_bdlora", "use_qalora", "velora_config")
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
    """An adapter: its config, its modules, its LoRAs on parameters (PEFT's `target_parameters`), and the base
    tensors it replaces (modules_to_save, saved embedding layers), each mapped to the source tensor that
    replaces it."""

    name: str
    config: dict
    modules: dict[str, ModuleAdapter] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)
    params: dict[tuple[str, int], ParamLora] = field(default_factory=dict)  # (module, nesting depth) -> its LoRA


def describe(config: dict, modules: int) -> str:
    """r, alpha and what varies per module, for the log line that says an adapter was found."""
    patterns = [f"{key} for {len(config[key])} modules" for key in ("rank_pattern", "alpha_pattern") if config.get(key)]
    return ", ".join([f"r={config['r']}", f"lora_alpha={config['lora_alpha']:g}", *patterns,
                      *(["rsLoRA"] if config.get("use_rslora") else []), f"{modules} adapted modules"])


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
        wrapped = wrapped_parameter(module, config.get("target_parameters") or ())
        if wrapped is not None:
            if part not in ("a", "b"):
                raise MergerError(f"tensor {key} is no lora_A or lora_B weight, and PEFT's LoRA on parameters "
                                  f"(target_parameters) has no other parts, {name}")
            p = adapter.params.setdefault(wrapped, ParamLora(*wrapped))
            setattr(p, part, source)
            continue
        if module.endswith(".base_layer"):  # only PEFT's nested LoRAs on parameters are named so
            raise MergerError(f"tensor {key} is a LoRA on a parameter of {module.split('.base_layer')[0]}, which "
                              f"the adapter config's target_parameters does not name, {name}")
        m = adapter.modules.setdefault(module, ModuleAdapter(module))
        setattr(m, part, source)
        m.embedding = m.embedding or "lora_embedding_" in key
    for p in adapter.params.values():
        if not p.a or not p.b:
            raise MergerError(f"module {p.module} has lora_{'B' if p.a else 'A'} but not lora_{'A' if p.a else 'B'} "
                              f"for a parameter (target_parameters), {name}")
    for m in adapter.modules.values():
        resolve_module(m, config, shapes, name)
    return adapter


def resolve_module(m: ModuleAdapter, config: dict, shapes: dict[str, tuple], name: str) -> None:
    """Sets the module's r, alpha and scale as PEFT resolves them, and checks r against lora_A's shape."""
    if not m.a or not m.b:
        raise MergerError(f"module {m.module} has lora_{'B' if m.a else 'A'} but not lora_{'A' if m.a else 'B'}, "
                          f"{name}")
    m.r = int(pattern_value(config.get("rank_pattern") or {}, m.module, config["r"]))
    if shapes[m.a][0] != m.r:
        raise MergerError(f"tensor {m.a} has rank {shapes[m.a][0]} but the adapter config gives module "
                          f"{m.module} r={m.r}, {name}")
    m.alpha = float(pattern_value(config.get("alpha_pattern") or {}, m.module, config["lora_alpha"]))
    m.scale = lora_scale(m.alpha, m.r, bool(config.get("use_rslora")))


def read_adapter_config(folder: Path) -> dict:
    if not (folder / CONFIG_FILE).is_file():
        raise MergerError(f"no adapter_config.json in the adapter folder, {folder}")
    return read_config_file(folder / CONFIG_FILE)


def read_config_file(path: Path) -> dict:
    """An adapter_config.json, checked: a LoRA adapter with positive r and lora_alpha, no variant we cannot fold."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise MergerError(f"adapter config file does not exist, {path}") from e
    except (OSError, ValueError) as e:
        raise MergerError(f"cannot read adapter_config.json ({e}), {path}") from e
    if not isinstance(config, dict):
        raise MergerError(f"adapter_config.json is not a JSON object, {path}")
    if config.get("peft_type", "LORA") != "LORA":
        raise MergerError(f"adapter is {config.get('peft_type')}, merger merges LORA adapters, {path}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise MergerError(f"adapter_config.json has no positive {key}, {path}")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise MergerError(f"adapter uses {key}, a LoRA variant merger does not fold, {path}")
    return config


def adapter_from_folder(folder: Path, prefix: str, catalog: Catalog) -> LoraAdapter:
    """The adapter in `folder`, whose tensors are in the merge catalog under `prefix` + file key."""
    return adapter_from_catalog(str(folder), read_adapter_config(folder), prefix, catalog)


def file_keys(catalog: Catalog, where: object) -> dict[str, str]:
    """Adapter-file-form key (without `base_model.model.`) -> tensor name, for a catalog of adapter-file names."""
    keys = {}
    for key in catalog.tensors:
        if not key.startswith(PEFT_PREFIX):
            raise MergerError(f"adapter tensor {key} does not start with {PEFT_PREFIX}, {where}")
        keys[key[len(PEFT_PREFIX):]] = key
    return keys


def adapter_from_catalog(name: str, config: dict, prefix: str, catalog: Catalog,
                         keys: dict[str, str] | None = None) -> LoraAdapter:
    """The adapter whose tensors `catalog` holds, found in a merge catalog under `prefix`; `keys` maps
    adapter-file-form keys to the catalog's names (default: the catalog holds them by adapter-file name)."""
    keys = {key: prefix + tensor for key, tensor in (keys or file_keys(catalog, name)).items()}
    shapes = {prefix + k: t.shape for k, t in catalog.tensors.items()}
    return build_adapter(name, config, keys, shapes)


def adapter_file_steps(tensors: dict[str, SourceTensor], keys: dict[str, str], file: str, prefix: str = ""
                       ) -> list[Step]:
    """The adapter's tensors (`keys`: adapter-file-form key -> name in `tensors`, read under `prefix` + name)
    copied under PEFT's file names into `file`, in their saved dtype: they are small, and PEFT upcasts them on
    load anyway."""
    return [cast(prefix + src, PEFT_PREFIX + key, tensors[src].shape, tensors[src].dtype, file)
            for key, src in keys.items()]


def config_from_tensors(keys: dict[str, str], shapes: dict[str, tuple], model_config: dict,
                        base: dict[str, str] | None, r: int | None, alpha: float, known: dict) -> dict:
    """adapter_config.json for an adapter saved without one: r and alpha as given (r defaults to the most common
    rank), the rest (ranks per module, targets, DoRA, lora_bias, modules_to_save) from the tensors themselves.

    `keys` maps adapter-file-form keys to source tensors; `base` (HF name -> tensor), when the base model is known,
    lets a leaf name (`q_proj`) stand for its modules when every module of that name is adapted; without it the
    targets are the full module names. `known` may give task_type and use_rslora.
    """
    # module -> its lora_A (or lora_embedding_A) tensor: the rank is that tensor's first dim
    modules = {split[0]: src for k, src in keys.items() if (split := split_key(k)) and split[1] == "a"}
    ranks = Counter(shapes[src][0] for src in modules.values())
    r = r or (ranks.most_common(1)[0][0] if ranks else 0)
    rank_pattern = {m: shapes[src][0] for m, src in sorted(modules.items()) if shapes[src][0] != int(r)}
    saved = sorted({k.rsplit(".", 1)[0] for k in keys if not split_key(k) and ".base_layer." not in k})
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    if base is None:
        targets = sorted(modules)
    else:
        base_modules = {n.rsplit(".", 1)[0] for n in base}
        every_leaf_adapted = all(m in modules for m in base_modules if m.rsplit(".", 1)[-1] in leaves)
        targets = sorted(leaves if every_leaf_adapted else modules)
    return {
        "peft_type": "LORA", "task_type": known.get("task_type", "CAUSAL_LM"), "base_model_name_or_path": None,
        "r": int(r), "lora_alpha": alpha, "use_rslora": bool(known.get("use_rslora", False)),
        "target_modules": targets, "rank_pattern": rank_pattern, "alpha_pattern": {},
        "modules_to_save": saved or None,
        "fan_in_fan_out": model_config.get("model_type") in _CONV1D_MODELS,
        "use_dora": any(k.endswith(".lora_magnitude_vector") for k in keys),
        "lora_bias": any(k.endswith(".lora_B.bias") for k in keys),
        "lora_dropout": 0.0, "bias": "none", "inference_mode": True, "init_lora_weights": True,
    }
