"""verl's `ckpt_contents.json`: where a Megatron actor/critic checkpoint keeps its model (layout schema v2).

verl's MegatronCheckpointManager writes it at the checkpoint root, paths relative to that root, rank 0 last
of all (after every async write), so its presence tells a finished save. The entries merger reads:
- `contents.model`: `format` "megatron_dist_checkpoint" (Megatron shards, `model/dist_ckpt`) or "huggingface"
  (weights written by mbridge / Megatron-Bridge, `model/huggingface`), the latter with `peft_adapter_path`
  (`model/huggingface/adapter`, Megatron-Bridge's HF PEFT export) when the run trained LoRA;
- `contents.hf_model` / `contents.hf_config`: the HF tree (config, tokenizer, weights) beside dist shards;
- `contents.peft_adapters`: the dist_ckpt holding the LoRA adapter shards, when `backend.peft` is true.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import MergerError, SourceError
from ..hf_folder import named_file

MANIFEST = "ckpt_contents.json"
DIST = "megatron_dist_checkpoint"
ADAPTER_DIR = "adapter"  # Megatron-Bridge's HF PEFT export inside the HF tree, as verl names it


@dataclass(frozen=True)
class VerlModel:
    """Where one verl Megatron checkpoint keeps its model; a folder may not exist unless the manifest names it."""

    dist_ckpt: Path  # Megatron torch_dist shards: the model, or only LoRA adapter shards, or none at all
    hf_dir: Path  # the HF tree: config and tokenizer, and the weights when mbridge wrote them
    adapter: Path | None  # the HF PEFT adapter folder Megatron-Bridge exported, when there is one
    manifest: Path | None  # ckpt_contents.json, when the save wrote it


def read_manifest(root: Path) -> VerlModel:
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SourceError(f"cannot read {MANIFEST} ({e}), {path}") from e
    contents = data.get("contents") if isinstance(data, dict) else None
    if not isinstance(contents, dict) or not all(isinstance(v, dict) for v in contents.values()):
        raise MergerError(f"{MANIFEST} has no 'contents' mapping of entries, {path}")

    def located(key: str, field: str = "path") -> Path | None:
        entry = contents.get(key) or {}
        if field not in entry:
            return None
        rel = entry[field]
        if not isinstance(rel, str) or not rel:
            raise MergerError(f"{MANIFEST} gives contents.{key}.{field} as {rel!r}, not a relative path, {path}")
        where = named_file(root, rel, path)
        if not where.exists():
            raise SourceError(f"{MANIFEST} names contents.{key}.{field} {rel!r}, which does not exist, {path}")
        return where

    model = contents.get("model") or {}
    dist = next((located(k) for k in ("model", "peft_adapters") if (contents.get(k) or {}).get("format") == DIST),
                None)
    hf = located("model") if model.get("format") == "huggingface" else located("hf_model") or located("hf_config")
    adapter = located("model", "peft_adapter_path")
    backend = data.get("backend") if isinstance(data.get("backend"), dict) else {}
    if adapter is None and hf is not None and backend.get("peft") and (hf / ADAPTER_DIR).is_dir():
        adapter = hf / ADAPTER_DIR  # a hybrid save names only the dist shards as `model`; the export is still here
    return VerlModel(dist or root / "model" / "dist_ckpt", hf or root / "model" / "huggingface", adapter, path)
