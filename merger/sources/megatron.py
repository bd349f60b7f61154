"""`--backend megatron`: a Megatron checkpoint in either on-disk format (legacy torch or torch_dist)."""
from __future__ import annotations

from pathlib import Path

from ..catalog import Catalog
from . import megatron_dist, megatron_legacy


def detect(root: Path) -> bool:
    return megatron_legacy.detect(root) or megatron_dist.detect(root)


def open_catalog(root: Path) -> Catalog:
    if megatron_legacy.detect(root):
        return megatron_legacy.open_catalog(root)
    return megatron_dist.open_catalog(root)
