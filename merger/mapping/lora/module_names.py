"""A base's tensors under the names an adapter gives its modules, where the checkpoint names them otherwise.

PEFT names each module it adapts as transformers' model names it (`model.layers.0.self_attn.q_a_proj`). Most
checkpoints store a module's weight under that name; some keep the names of their authors' own code, which
transformers renames as it loads them (its conversion_mapping): DeepSeek-V4 stores `model.layers.0.attn.wq_a.weight`
for that module, and its routed experts as `model.layers.0.ffn.experts.{e}.w1.weight` (w1, w3, w2), which transformers
stacks into `model.layers.0.mlp.experts.gate_up_proj` and `down_proj`. The fold reads such a base under the names
transformers' own renames give it (its WeightRenamings, in its loader's order; the converters that stack experts are
not applied: expert_params.py reads a parameter's experts where the checkpoint keeps them, `mlp.experts.{e}.w1.weight`
after the renames) and writes each tensor back under its checkpoint name.

Asked only when an adapter names a module or tensor the base does not hold under its own names: the answer needs the
model's class built on the meta device (seconds). Where transformers cannot build it, renames none, or renames two
tensors to one name, the base keeps its names (and the fold then names the module it cannot find).
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..meta_model import meta_model
from ..saved_names import rename_outputs
from ..steps import Step
from .adapter import LoraAdapter

log = logging.getLogger("merger")


def _held(names: list[str], adapters: list[LoraAdapter]) -> bool:
    """Whether the base holds every module and tensor the adapters name under the names they give them."""
    modules = {name.rsplit(".", n)[0] for name in names for n in range(1, name.count(".") + 1)}
    wanted = [m for a in adapters for m in (*a.modules, *(p.module for p in a.params.values()))]
    return all(m in modules for m in wanted) and all(t in names for a in adapters for t in a.replacements)


def _renamed(hf_dir: Path, config: dict, names: list[str], trust_remote_code: bool) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [t for t in get_model_conversion_mapping(meta_model(hf_dir, config, trust_remote_code))
                 if isinstance(t, WeightRenaming)]
    return {name: apply_renamings(name, renamings) for name in names}


def adapter_names(hf_dir: Path, config: dict, names: list[str], adapters: list[LoraAdapter],
                  trust_remote_code: bool) -> dict[str, str]:
    """{checkpoint name: the name the adapters' modules give it} for each of the base's tensors `names` that
    transformers renames on load; {} when the base holds what the adapters name, or no one-to-one rename is known."""
    if _held(names, adapters):
        return {}
    try:
        renamed = _renamed(hf_dir, config, names, trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers' internal API: without it, the base keeps its names
        log.debug("merger: keeping the base's names, transformers' load-time names unavailable (%s)", e)
        return {}
    if len(set(renamed.values())) != len(renamed):
        return {}
    return {old: new for old, new in renamed.items() if old != new}


def under_own_names(steps: list[Step], names: dict[str, str]) -> tuple[list[Step], tuple[str, ...]]:
    """`steps` (the fold, over the base as `names` renamed it) writing each tensor under its checkpoint name, and the
    log's note that says so (none when `names` renamed nothing)."""
    own = {new: old for old, new in names.items()}
    if not own:
        return steps, ()
    # the example: a tensor an adapter folds into, where one is renamed
    new = next((o.name for s in steps if not s.is_cast for o in s.outputs if o.name in own), next(iter(own)))
    return rename_outputs(steps, own), (f"merger: the adapters name the base's modules as transformers' model does: "
                                        f"{len(own)} of its tensors read under those names (e.g. {own[new]} as {new}), "
                                        f"written under their own",)
