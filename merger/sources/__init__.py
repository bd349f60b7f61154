"""Checkpoint formats: each module turns a folder into a Catalog from metadata alone.

A format is registered here by name with `detect(root) -> bool` and `open_catalog(root) -> Catalog`;
`--backend auto` picks the first whose detect() accepts the folder.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
from pathlib import Path

from ..catalog import Catalog
from ..errors import MergerError, SourceError
from ..hf_folder import CONFIG_DIR
from .megatron_layout import TRACKER  # verl names its run's last step the same way

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


def _step_number(folder: Path) -> int | None:
    """N of a step folder as trainers name them: global_step_N (verl), checkpoint-N (HF Trainer), step-N, iter_N."""
    match = re.fullmatch(r"(?:global_step_|checkpoint-|step-|iter_)(\d+)", folder.name)
    return int(match.group(1)) if match else None


def _latest_step(run: Path) -> tuple[Path, str] | None:
    """The checkpoint of the run's latest step, with its backend: the step that verl's (and Megatron's)
    latest_checkpointed_iteration.txt names, else the highest-numbered one; its actor/ (critic/) where the step
    folder holds the roles."""
    steps = sorted((p for p in run.iterdir() if p.is_dir() and _step_number(p) is not None), key=_step_number)
    with contextlib.suppress(OSError, ValueError):
        latest = int((run / TRACKER).read_text().strip())
        steps = [p for p in steps if _step_number(p) == latest] or steps
    for step in reversed(steps):
        for folder in (step, step / "actor", step / "critic"):
            if folder.is_dir() and (name := _detect(folder)):
                return folder, name
    return None


def _layout_hint(root: Path) -> str:
    """Where the checkpoint probably is, for the usual slips: a run folder (its latest step), a step folder
    (global_step_N/ instead of global_step_N/actor), or the checkpoint's huggingface/ config folder."""
    if root.name == CONFIG_DIR and (name := _detect(root.parent)):
        return f"; this is a checkpoint's HF config folder: pass the checkpoint ({name}), --local_dir {root.parent}"
    below = [(sub, name) for sub in sorted(p for p in root.iterdir() if p.is_dir() and _step_number(p) is None)
             if (name := _detect(sub))]
    if below:
        return "".join(f"; {sub.name}/ below it looks like a checkpoint (--backend {name}): pass --local_dir {sub}"
                       for sub, name in below)
    if (latest := _latest_step(root)) is not None:
        return f"; it looks like a training run's folder: pass its latest checkpoint ({latest[1]}), " \
               f"--local_dir {latest[0]}"
    return ""


def detect_backend(root: Path) -> str:
    if found := _detect(root):
        return found
    raise SourceError(f"no known checkpoint layout (looked for: {', '.join(BACKENDS)}), {root}{_layout_hint(root)}")


def open_catalog(root: Path, backend: str = "auto", prefix: str | None = None) -> Catalog:
    from .verl_engines import locate  # verl's torchtitan and automodel engines save beside or below the folder named

    try:
        root.exists()  # the first request to a bucket: a store that refuses it names the folder given, not a probe
        if (save := locate(root)) is not None:
            return save.annotate(_open_folder(save.folder, backend, prefix))
        return _open_folder(root, backend, prefix)
    except PermissionError as e:
        if e.filename is None:
            raise
        raise _denied(Path(e.filename)) from e


def _denied(path: Path) -> SourceError:
    """The path a denied request could not get past: the probes ask for paths below a folder this user cannot
    enter (`model/.hf_metadata` of a chmod 000 checkpoint), which the error names although they need not exist."""
    folder = next((p for p in reversed(path.parents) if not os.access(p, os.X_OK)), None)
    if folder is not None:
        return SourceError(f"permission denied: cannot list the folder, {folder}")
    return SourceError(f"permission denied: cannot {'list the folder' if path.is_dir() else 'read the file'}, {path}")


def _open_folder(root: Path, backend: str, prefix: str | None) -> Catalog:
    if not root.exists():
        raise SourceError(f"checkpoint folder does not exist, {root}")
    if not root.is_dir():
        hint = f"; pass the folder that holds it: --local_dir {root.parent}" if _detect(root.parent) else ""
        raise SourceError(f"checkpoint path is not a folder, {root}{hint}")
    if backend == "auto":
        backend = detect_backend(root)
    elif backend not in BACKENDS:
        raise MergerError(f"unknown backend {backend!r} (known: auto, {', '.join(BACKENDS)}), {root}")
    elif not _module(backend).detect(root):
        raise SourceError(f"folder is not a {backend} checkpoint, {root}")
    if prefix is None:
        return _module(backend).open_catalog(root)
    if backend not in PREFIX_BACKENDS:
        raise MergerError(f"--prefix applies to {', '.join(sorted(PREFIX_BACKENDS))} checkpoints, not {backend}, "
                          f"{root}")
    return _module(backend).open_catalog(root, prefix=prefix)
