"""Checkpoint formats: each module turns a folder into a Catalog from metadata alone.

A format is registered here by name with `detect(root) -> bool` and `open_catalog(root) -> Catalog`;
`--backend auto` picks the first whose detect() accepts the folder.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError

# name -> module under merger.sources; order matters for auto-detection (most specific first).
BACKENDS = {
    "fsdp": "fsdp",
    "deepspeed": "deepspeed",  # before hf: HF Trainer's checkpoint-N/ may hold a model.safetensors beside it
    "megatron": "megatron",
    "dcp": "dcp",  # after formats that wrap a DCP folder in their own layout (Megatron torch_dist)
    "dcp_hf": "dcp_hf_shards",  # before hf: its shard-*.safetensors files would pass for a HF folder's
    "hf": "hf_safetensors",
}
# Backends whose tensor names can carry a nesting prefix that `--prefix` chooses.
PREFIX_BACKENDS = {"dcp"}


def _module(name: str):
    return importlib.import_module(f"{__name__}.{BACKENDS[name]}")


def _detect(root: Path) -> str | None:
    return next((name for name in BACKENDS if _module(name).detect(root)), None)


def detect_backend(root: Path) -> str:
    if found := _detect(root):
        return found
    # A common slip: --local_dir one level too high (global_step_N/ instead of global_step_N/actor).
    below = [(sub, name) for sub in sorted(p for p in root.iterdir() if p.is_dir()) if (name := _detect(sub))]
    hint = "".join(f"; {sub.name}/ below it looks like a checkpoint (--backend {name}): pass --local_dir {sub}"
                   for sub, name in below)
    raise MergerError(f"no known checkpoint layout (looked for: {', '.join(BACKENDS)}), {root}{hint}")


def open_catalog(root: Path, backend: str = "auto", prefix: str | None = None) -> Catalog:
    from .verl_engines import locate  # verl's torchtitan and automodel engines save beside or below the folder named

    if (save := locate(root)) is not None:
        return save.annotate(_open_folder(save.folder, backend, prefix))
    return _open_folder(root, backend, prefix)


def _open_folder(root: Path, backend: str, prefix: str | None) -> Catalog:
    if not root.exists():
        raise MergerError(f"checkpoint folder does not exist, {root}")
    if not root.is_dir():
        raise MergerError(f"checkpoint path is not a folder, {root}")
    if backend == "auto":
        backend = detect_backend(root)
    elif backend not in BACKENDS:
        raise MergerError(f"unknown backend {backend!r} (known: auto, {', '.join(BACKENDS)}), {root}")
    elif not _module(backend).detect(root):
        raise MergerError(f"folder is not a {backend} checkpoint, {root}")
    if prefix is None:
        return _module(backend).open_catalog(root)
    if backend not in PREFIX_BACKENDS:
        raise MergerError(f"--prefix applies to {', '.join(sorted(PREFIX_BACKENDS))} checkpoints, not {backend}, "
                          f"{root}")
    return _module(backend).open_catalog(root, prefix=prefix)
