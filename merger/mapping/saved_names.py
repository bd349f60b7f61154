"""Output names as the installed transformers' `save_pretrained` writes them.

transformers 5 renames some models' modules (Qwen2-VL: `model.language_model.*`, `model.visual.*`) but saves
them under the checkpoint names the Hub and serving engines know (`model.*`, `visual.*`), renaming back on
load. A training checkpoint holds the module names; to write what save_pretrained would, merger asks
transformers itself: the model is built on the meta device (no memory) and its own save-time renaming is
applied to the names. Only pure renames are taken; anything else keeps the module names, which load too.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from .steps import Step

log = logging.getLogger("merger")


def saved_names(hf_dir: Path, config: dict, names: list[str], trust_remote_code: bool) -> dict[str, str]:
    """{module name: saved name} for every name transformers renames on save; {} when it renames none."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    # Only composite models (a VLM's text_config + vision_config, audio models...) are saved under other names
    # than their modules; asking transformers costs every rank ~200 MiB and seconds, so plain LMs skip it.
    composite = any(key.endswith("_config") and isinstance(value, dict) for key, value in config.items())
    if "auto_map" in config or not model_type or not archs or not composite:
        return {}
    try:
        import transformers
        from transformers.core_model_loading import revert_weight_conversion

        model_class = getattr(transformers, archs[0], None)
        if model_class is None:
            return {}
        hf_config = transformers.AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = model_class(hf_config)
        # One distinct placeholder per name: a pure rename hands the same object back under its new name.
        placeholders = {name: torch.empty(0, device="meta") for name in names}
        renamed = revert_weight_conversion(model, dict(placeholders))
    except Exception as e:  # noqa: BLE001 - an internal API of transformers: without it, module names load too
        log.debug("merger: keeping module names, transformers' save-time names unavailable (%s)", e)
        return {}
    by_id = {id(t): name for name, t in placeholders.items()}
    mapping = {by_id.get(id(t)): new for new, t in renamed.items()}
    if None in mapping or len(mapping) != len(names):
        return {}  # a conversion that is more than a rename (fused or split tensors): keep module names
    return {old: new for old, new in mapping.items() if old != new}


def rename_outputs(steps: list[Step], names: dict[str, str]) -> list[Step]:
    if not names:
        return steps
    return [dataclasses.replace(s, outputs=tuple(dataclasses.replace(o, name=names.get(o.name, o.name))
                                                 for o in s.outputs)) for s in steps]
