"""Where a Megatron checkpoint's files are: verl's actor folders, a Megatron-LM save dir, or one iter dir.

- verl: `actor/{huggingface,dist_ckpt}` (older) or `actor/model/{huggingface,dist_ckpt}` (newer);
- Megatron-LM: `latest_checkpointed_iteration.txt` (a number or `release`) beside `iter_XXXXXXX/`;
- or the iteration folder itself.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import MergerError

TRACKER = "latest_checkpointed_iteration.txt"


def verl_dirs(root: Path) -> tuple[Path, Path] | None:
    """(dist_ckpt, huggingface) of a verl actor/critic folder, or None."""
    for base in (root / "model", root):
        if (base / "dist_ckpt").is_dir():
            return base / "dist_ckpt", base / "huggingface"
    return None


def checkpoint_dir(root: Path) -> tuple[Path, Path | None]:
    """The folder holding the weights and the HF config folder beside it (None when there is none)."""
    verl = verl_dirs(root)
    if verl:
        ckpt, hf = verl
        return ckpt, hf if hf.is_dir() else None
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return root / "release", None
        try:
            return root / f"iter_{int(text):07d}", None
        except ValueError as e:
            raise MergerError(f"{TRACKER} holds {text!r}, not an iteration number, {tracker}") from e
    return root, None
