"""`merger lora`: fold PEFT adapter folders, in order, into a HF safetensors base model, streaming the base.

The base folder and every adapter become one catalog (adapter k's tensors under the prefix `adapter{k}:`),
the fold rules in steps.py give the steps, and the usual merge writes the target, with the base's config and
tokenizer files (config `tie_word_embeddings: false` when an adapter untied the embeddings). `fold_into_base`
is shared with adapter-only DCP checkpoints given a base model (adapter_state.py).
"""
from __future__ import annotations

from pathlib import Path

from ...catalog import Catalog
from ...engine.dist import Group, on_every_rank
from ...engine.plan import Step, plan_layout
from ...errors import MergerError
from ...merge import Prepared, log_prepared
from ...options import MergeOptions
from ...sources import hf_safetensors
from ...sources.union import union_catalog
from ..registry import read_config
from .adapter import LoraAdapter, adapter_from_folder, open_adapter_catalog
from .fold_steps import fold_steps


def open_base(base_dir: Path) -> Catalog:
    if not base_dir.is_dir():
        raise MergerError(f"base model folder does not exist, {base_dir}")
    if not hf_safetensors.detect(base_dir):
        raise MergerError(f"no safetensors weights in the base model folder, {base_dir}")
    return hf_safetensors.open_catalog(base_dir)


def fold_into_base(base_dir: Path, base: Catalog, parts: dict[str, Catalog], adapters: list[LoraAdapter],
                   options: MergeOptions, world: int, fmt: str, side_steps: tuple[Step, ...] = (),
                   extra_files: dict[str, str] | None = None, notes: tuple[str, ...] = ()) -> Prepared:
    """The plan writing `base` with `adapters` folded in; `parts` maps each adapter catalog to its name prefix.
    `side_steps` and `extra_files` add outputs beside the model (an adapter folder)."""
    catalog = union_catalog({"": base, **parts}, base_dir, fmt)
    config = read_config(base_dir)
    result = fold_steps({n: n for n in base.tensors}, adapters, catalog.tensors, config, options.torch_dtype,
                        options.tie_word_embedding)
    plan = plan_layout(catalog, result.steps + list(side_steps), world, options.max_shard_size, options.max_inflight)
    updates = {"tie_word_embeddings": False} if result.untied else {}
    return Prepared(catalog, base_dir, config, plan, updates, dict(extra_files or {}), notes)


def prepare_lora(options: MergeOptions, adapter_dirs: list[Path], group: Group) -> Prepared:
    """Catalog and plan for base `options.local_dir` plus `adapter_dirs`, identical on every rank."""
    def build():
        base_dir = Path(options.local_dir)
        base = open_base(base_dir)
        parts = {f"adapter{k}:": open_adapter_catalog(Path(folder)) for k, folder in enumerate(adapter_dirs)}
        adapters = [adapter_from_folder(Path(folder), f"adapter{k}:", parts[f"adapter{k}:"])
                    for k, folder in enumerate(adapter_dirs)]
        return fold_into_base(base_dir, base, parts, adapters, options, group.world, "hf_safetensors+peft_adapter")

    return log_prepared(on_every_rank(group, build, options.debug), group)
