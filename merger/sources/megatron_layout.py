"""Where a Megatron checkpoint's files are: verl's actor folders, a Megatron-LM save dir, or one iter dir.

- verl: `actor/{huggingface,dist_ckpt}` (older) or `actor/model/{huggingface,dist_ckpt}` (newer, located
  through `ckpt_contents.json` when the save wrote it: verl_manifest.py);
- Megatron-LM: `latest_checkpointed_iteration.txt` (a number or `release`) beside `iter_XXXXXXX/`;
- or the iteration folder itself.
A Megatron-LM save dir may hold the model's HF config folder as `huggingface/` beside the iterations (verl's
converters and Megatron-Bridge put it there): it is found there as in verl's folders.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import MergerError
from ..hf_folder import CONFIG_DIR, config_dir
from .verl_manifest import ADAPTER_DIR, MANIFEST, VerlModel, read_manifest

TRACKER = "latest_checkpointed_iteration.txt"


def verl_model(root: Path) -> VerlModel | None:
    """Where a verl actor/critic folder keeps its model, or None when `root` is no such folder."""
    if (root / MANIFEST).is_file():
        return read_manifest(root)
    for base in (root / "model", root):
        if (base / "dist_ckpt").is_dir() or (base / CONFIG_DIR).is_dir() and base.name == "model":
            adapter = base / CONFIG_DIR / ADAPTER_DIR
            return VerlModel(base / "dist_ckpt", base / CONFIG_DIR, adapter if adapter.is_dir() else None, None)
    return None


def checkpoint_dir(root: Path) -> tuple[Path, Path | None]:
    """The folder holding the Megatron shards and the HF config folder beside it (None when there is none)."""
    verl = verl_model(root)
    if verl:
        return verl.dist_ckpt, config_dir(verl.hf_dir)
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return root / "release", _hf_beside(root)
        try:
            return root / f"iter_{int(text):07d}", _hf_beside(root)
        except ValueError as e:
            raise MergerError(f"{TRACKER} holds {text!r}, not an iteration number, {tracker}") from e
    # An iteration folder given itself: its save dir is the parent when the tracker file says so.
    return root, _hf_beside(root.parent) if (root.parent / TRACKER).is_file() else None


def _hf_beside(save_dir: Path) -> Path | None:
    return config_dir(save_dir / CONFIG_DIR)
