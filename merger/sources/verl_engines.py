"""Where verl's torchtitan and automodel engines put the weights, found from the folders verl names.

verl's trainers call the engine's save_checkpoint with `global_step_N/actor` (PPO) or `global_step_N` (SFT):
- automodel (verl/workers/engine/automodel): NeMo Automodel's Checkpointer, safetensors with consolidation on every
  save, writes `actor/model/` (each rank's `shard-*-model-*-of-*.safetensors` from torch's HuggingFaceStorageWriter,
  `.hf_metadata/` with config.json, `consolidate.sh`), `actor/model/consolidated/` (a HF folder: the same tensors
  under HF names, index, config) and `actor/optim/` (optimizer and scheduler, DCP). The consolidated folder is
  read when it holds exactly the tensors of the shards; otherwise (consolidation not run or not finished) the
  shards are, with `.hf_metadata/`'s config.
- torchtitan (verl/workers/engine/torchtitan): torchtitan's CheckpointManager, its folder set to the parent of the
  path verl passes, writes `step-N/` (DCP: torchtitan names, with the optimizer, LR scheduler and train state)
  beside `actor/` (PPO: `global_step_N/step-N/`) or beside `global_step_N/` (SFT); `actor/` is never created.
  It saves no HF config: that comes from --hf_model_config_path.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import config_dir, weight_files
from . import dcp, dcp_hf_shards, hf_safetensors

GLOBAL_STEP = re.compile(r"global_step_(\d+)")
AUTOMODEL_METADATA = ".hf_metadata"  # Automodel's own copy of the config, kept for offline consolidation
AUTOMODEL_PARTS = ("model", "optim")  # what its Checkpointer writes into the folder verl gives it
AUTOMODEL_MODEL_PARTS = ("consolidated", AUTOMODEL_METADATA, "consolidate.sh")  # beside the shards in model/


@dataclass(frozen=True)
class EngineSave:
    folder: Path  # what the format's own source reads
    description: str  # for `inspect` and the summary: which engine, which folder, why
    hf_dir: Path | None = None  # the config folder, where the format's source would not find it
    skipped: dict[str, str] = field(default_factory=dict)  # entries of the save not merged -> why

    def annotate(self, catalog: Catalog) -> Catalog:
        catalog.details = {"verl_engine": self.description, **catalog.details}
        catalog.skipped.update(self.skipped)
        catalog.hf_dir = catalog.hf_dir or self.hf_dir
        return catalog


def locate(root: Path) -> EngineSave | None:
    """The engine save `root` names (an automodel `actor/` or its `actor/model/`, or a torchtitan save's
    `global_step_N/actor` or `global_step_N`), or None when `root` is no such folder."""
    actor = root.parent if root.name == "model" else root
    if (actor / "model" / AUTOMODEL_METADATA).is_dir() or (actor / "model" / "consolidated").is_dir():
        return _automodel(actor)
    return _torchtitan(root)


def _automodel(root: Path) -> EngineSave:
    model = root / "model"
    shards = dcp_hf_shards.shard_files(model)
    strays = [p for p in sorted(root.iterdir()) if p.name not in AUTOMODEL_PARTS]
    strays += [p for p in sorted(model.iterdir()) if p.name not in AUTOMODEL_MODEL_PARTS and p not in shards]
    skipped = {f"{p.relative_to(root)}{'/' if p.is_dir() else ''}": "not written by verl's automodel engine, "
               "left alone" for p in strays}
    if (root / "optim").is_dir():
        skipped["optim/"] = "optimizer and scheduler state (automodel engine)"
    metadata = config_dir(model / AUTOMODEL_METADATA)
    consolidated = model / "consolidated"
    if weight_files(consolidated):
        why = _differs_from_shards(consolidated, model) if shards else None
        if why is None:
            if shards:
                skipped["model/shard-*.safetensors"] = "the same tensors before consolidation (automodel engine)"
            return EngineSave(consolidated, "automodel: model/consolidated/ (HF safetensors)",
                              config_dir(consolidated, model / AUTOMODEL_METADATA), skipped)
        skipped["model/consolidated/"] = f"{why}: the shards beside it are read"
    if not shards:
        raise MergerError(f"verl automodel save holds no weights (no model/consolidated/*.safetensors and no "
                          f"model/shard-*-model-*-of-*.safetensors), {model}")
    return EngineSave(model, "automodel: model/shard-*.safetensors (not consolidated)", metadata, skipped)


def _differs_from_shards(consolidated: Path, model: Path) -> str | None:
    """Why the consolidated folder cannot stand for the shards (a consolidation cut short), or None."""
    try:
        merged = hf_safetensors.open_catalog(consolidated).tensors
    except MergerError as e:  # e.g. the index written, a file it names not yet
        return f"consolidation unreadable ({e})"
    sharded = dcp_hf_shards.open_catalog(model).tensors
    missing = sorted(set(sharded) - set(merged))
    if missing:
        return f"consolidation incomplete ({len(missing)} of {len(sharded)} tensors missing, e.g. {missing[0]})"
    for name, tensor in merged.items():
        other = sharded.get(name)
        if other is None or (other.shape, other.dtype) != (tensor.shape, tensor.dtype):
            return f"tensor {name} is not the shards' ({'absent there' if other is None else other.shape})"
    return None


def _torchtitan(root: Path) -> EngineSave | None:
    """verl's torchtitan engine saves `step-N/` into the parent of the path it is given."""
    if root.name == "actor" and (not root.exists() or (root.is_dir() and not any(root.iterdir()))):
        step_dir, places = root.parent, ("global_step_N/actor: the PPO trainer's",)
    elif root.is_dir() and not dcp.detect(root):
        step_dir, places = root, ("global_step_N/actor: the PPO trainer's", "global_step_N: the SFT trainer's")
    else:
        return None
    match = GLOBAL_STEP.fullmatch(step_dir.name)
    if match is None:
        return None
    name = f"step-{match.group(1)}"
    for folder, place in zip((step_dir / name, step_dir.parent / name), places):
        if dcp.detect(folder):
            return EngineSave(folder, f"torchtitan: {folder.relative_to(step_dir.parent)}/ (saved for {place})")
    return None
