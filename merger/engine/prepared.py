"""What a merge is about to do, made by api/pipeline.prepare: the catalog it reads, the plan it writes, and what the
mapping found for the rest of the folder (config changes, extra files, notes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from .plan import Plan


@dataclass
class Prepared:
    catalog: Catalog  # what the plan reads: the checkpoint, or it and a base model (mapping.catalog)
    hf_dir: Path | None  # None: the target is no HF model folder (an adapter folder), nothing to copy from
    plan: Plan
    config_updates: dict = field(default_factory=dict)
    config_removals: tuple[str, ...] = ()
    files_left_out: tuple[str, ...] = ()  # files of hf_dir not copied (Mapping.files_left_out)
    extra_files: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what the merge found and does, logged once by rank 0
    base_model: Path | None = None  # --base_model's folder (a Hub id's snapshot folder), a source like the others
