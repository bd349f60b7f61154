"""`merger lora`: fold PEFT adapter folders, in order, into a HF safetensors base model, streaming the base.

The base folder and every adapter become one catalog (adapter k's tensors under the prefix `adapter{k}:`),
the fold rules in steps.py give the steps, and the usual merge writes the target, with the base's config and
tokenizer files (config `tie_word_embeddings: false` when an adapter untied the embeddings).
"""
from __future__ import annotations

from pathlib import Path

from ..dist import Group, on_every_rank
from ..errors import MergerError
from ..mapping import read_config
from ..merge import Prepared, log_prepared
from ..options import MergeOptions
from ..plan import plan_layout
from ..sources import hf_safetensors
from ..sources.union import union_catalog
from .adapter import adapter_from_folder, open_adapter_catalog
from .steps import fold_steps


def prepare_lora(options: MergeOptions, adapter_dirs: list[Path], group: Group) -> Prepared:
    """Catalog and plan for base `options.local_dir` plus `adapter_dirs`, identical on every rank."""
    def build():
        base_dir = Path(options.local_dir)
        if not base_dir.is_dir():
            raise MergerError(f"base model folder does not exist, {base_dir}")
        base = hf_safetensors.open_catalog(base_dir) if hf_safetensors.detect(base_dir) else None
        if base is None:
            raise MergerError(f"no safetensors weights in the base model folder, {base_dir}")
        parts = {"": base}
        for k, folder in enumerate(adapter_dirs):
            parts[f"adapter{k}:"] = open_adapter_catalog(Path(folder))
        catalog = union_catalog(parts, base_dir, "hf_safetensors+peft_adapter")
        adapters = [adapter_from_folder(Path(folder), f"adapter{k}:", parts[f"adapter{k}:"])
                    for k, folder in enumerate(adapter_dirs)]
        config = read_config(base_dir)
        result = fold_steps({n: n for n in base.tensors}, adapters, catalog.tensors, config,
                            options.torch_dtype, options.tie_word_embedding)
        plan = plan_layout(catalog, result.steps, group.world, options.max_shard_size, options.max_inflight)
        updates = {"tie_word_embeddings": False} if result.untied else {}
        return Prepared(catalog, base_dir, config, plan, updates)

    return log_prepared(on_every_rank(group, build, options.debug), group)
