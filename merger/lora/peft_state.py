"""FSDP checkpoints of PEFT-wrapped models: fold the adapter into the base (default) or keep it apart, and
write it as a PEFT adapter folder `lora_adapter/` that PEFT loads onto the merged base.

The state dict of a PEFT-wrapped model names base weights `base_model.model.<m>.base_layer.weight` and the
adapter `<m>.lora_A.<adapter>.weight`; modules_to_save appear as `<m>.original_module.*` beside
`<m>.modules_to_save.<adapter>.*`. r and lora_alpha are not in the weights: they come from
`lora_train_meta.json` beside the rank files (verl writes it), or from --lora-r / --lora-alpha.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from ..plan import OutputSpec, Step
from .adapter import PEFT_PREFIX, build_adapter, split_key
from .steps import fold_steps

ADAPTER_DIR = "lora_adapter"
ADAPTER_FILE = f"{ADAPTER_DIR}/adapter_model.safetensors"
META = "lora_train_meta.json"
_PART = re.compile(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)"
                   r"(\.weight|\.bias)?$")
_SAVED = re.compile(r"^(.*)\.modules_to_save\.([^.]+)\.(.*)$")
# transformers models built on Conv1D, whose weights are stored [in, out] (PEFT's fan_in_fan_out)
_CONV1D_MODELS = {"gpt2", "openai-gpt", "imagegpt", "decision_transformer"}


def is_peft_state(catalog: Catalog) -> bool:
    names = list(catalog.tensors)
    return all(n.startswith(PEFT_PREFIX) for n in names) and any(_PART.match(n) for n in names)


def _split_names(catalog: Catalog) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """(HF name -> base source tensor, adapter-file-form key -> source tensor, adapter names seen)."""
    base, keys, names = {}, {}, set()
    for name in catalog.tensors:
        rel = name[len(PEFT_PREFIX):]
        if m := _PART.match(rel):
            module, part, adapter, tail = m.groups()
            names.add(adapter)
            keys[f"{module}.{part}{tail or ''}".replace("lora_magnitude_vector.weight", "lora_magnitude_vector")] = name
        elif m := _SAVED.match(rel):
            names.add(m.group(2))
            keys[f"{m.group(1)}.{m.group(3)}"] = name
        else:
            base[rel.replace(".base_layer.", ".").replace(".original_module.", ".")] = name
    return base, keys, names


def _read_meta(root: Path) -> dict:
    path = root / META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MergerError(f"cannot read {META} ({e}), {path}") from e
    if not isinstance(meta, dict):
        raise MergerError(f"{META} is not a JSON object, {path}")
    return meta


def _resolve(meta: dict, flag, key: str, flag_name: str, root: Path):
    """A value from the meta file, else the flag; both given and different is an error, not a guess."""
    known = meta.get(key)
    if known is not None and flag is not None and float(known) != float(flag):
        raise MergerError(f"{flag_name} {flag} disagrees with {META}'s {key}={known}, {root / META}")
    return known if known is not None else flag


def adapter_config(catalog: Catalog, config: dict, options: MergeOptions, keys: dict[str, str],
                   base: dict[str, str]) -> dict:
    """adapter_config.json for the checkpoint's adapter: r and alpha from the meta file or flags, the rest
    (ranks per module, targets, DoRA, lora_bias, modules_to_save) from the tensors themselves."""
    meta = _read_meta(catalog.root)
    # module -> its lora_A (or lora_embedding_A) tensor: the rank is that tensor's first dim
    modules = {split[0]: src for k, src in keys.items() if (split := split_key(k)) and split[1] == "a"}
    ranks = Counter(catalog.tensors[src].shape[0] for src in modules.values())
    r = _resolve(meta, options.lora_r, "r", "--lora-r", catalog.root) or (ranks.most_common(1)[0][0] if ranks else 0)
    alpha = _resolve(meta, options.lora_alpha, "lora_alpha", "--lora-alpha", catalog.root)
    if not alpha:
        raise MergerError(f"the checkpoint holds a LoRA adapter but its lora_alpha is unknown: no {META} with "
                          f"lora_alpha; pass --lora-alpha (and --lora-r) as used in training, {catalog.root}")
    rank_pattern = {m: catalog.tensors[src].shape[0] for m, src in sorted(modules.items())
                    if catalog.tensors[src].shape[0] != int(r)}
    saved = sorted({k.rsplit(".", 1)[0] for k in keys if not split_key(k)})
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    base_modules = {n.rsplit(".", 1)[0] for n in base}
    every_leaf_adapted = all(m in modules for m in base_modules if m.rsplit(".", 1)[-1] in leaves)
    return {
        "peft_type": "LORA", "task_type": meta.get("task_type", "CAUSAL_LM"), "base_model_name_or_path": None,
        "r": int(r), "lora_alpha": alpha, "use_rslora": bool(meta.get("use_rslora", False)),
        "target_modules": sorted(leaves if every_leaf_adapted else modules),
        "rank_pattern": rank_pattern, "alpha_pattern": {}, "modules_to_save": saved or None,
        "fan_in_fan_out": config.get("model_type") in _CONV1D_MODELS,
        "use_dora": any(k.endswith(".lora_magnitude_vector") for k in keys),
        "lora_bias": any(k.endswith(".lora_B.bias") for k in keys),
        "lora_dropout": 0.0, "bias": "none", "inference_mode": True, "init_lora_weights": True,
    }


def peft_state_mapping(catalog: Catalog, config: dict, options: MergeOptions):
    from ..mapping import Mapping

    base, keys, names = _split_names(catalog)
    if len(names) > 1:
        raise MergerError(f"the checkpoint holds several LoRA adapters {sorted(names)}; merger folds one, "
                          f"{catalog.root}")
    peft_config = adapter_config(catalog, config, options, keys, base)
    adapter = build_adapter(f"adapter in {catalog.root}", peft_config, keys,
                            {n: t.shape for n, t in catalog.tensors.items()})
    fused = fold_steps(base, [adapter] if options.lora == "fuse" else [], catalog.tensors, config,
                       options.torch_dtype, options.tie_word_embedding)
    # The adapter keeps its own dtype: it is small, and PEFT upcasts it to fp32 on load anyway.
    steps = fused.steps + [Step((src,), (OutputSpec(PEFT_PREFIX + key, catalog.tensors[src].shape,
                                                    catalog.tensors[src].dtype, ADAPTER_FILE),))
                           for key, src in keys.items()]
    return Mapping(steps, {"tie_word_embeddings": False} if fused.untied else {},
                   {f"{ADAPTER_DIR}/adapter_config.json": json.dumps(peft_config, indent=2) + "\n"})
