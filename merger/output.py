"""The target folder: staged beside it, written at planned offsets by every rank, renamed into place at the end.

Until the final rename nothing at the target looks like a model: the work happens in a hidden staging
folder `.<target>.merger-partial` next to it, so the rename is atomic on the same filesystem.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .errors import MergerError
from .plan import OutputSpec, Plan

# Weight files of the source's HF folder are never copied: the merge writes the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MANIFEST = "merge_manifest.json"


def staging_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.merger-partial"


def check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise MergerError(f"target exists and is not a folder, {target}")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise MergerError(f"target folder is not empty (pass --overwrite to replace it), {target}")
    parent = target.parent
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MergerError(f"cannot create the target's parent folder ({e.strerror}), {parent}") from e
    if not os.access(parent, os.W_OK):
        raise MergerError(f"target's parent folder is not writable, {parent}")


def prepare_files(stage: Path, plan: Plan) -> None:
    """Create every output file at its final size with its header in place (rank 0, before streaming)."""
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in plan.files:
        with open(stage / f.name, "wb") as out:
            out.write(f.prefix)
            out.truncate(f.size)


class FileSink:
    """Writes each output tensor's bytes at its planned offset; several ranks write one file side by side."""

    def __init__(self, stage: Path, plan: Plan):
        self.stage, self.plan = stage, plan
        self.fds: dict[int, int] = {}

    def _fd(self, index: int) -> int:
        if index not in self.fds:
            self.fds[index] = os.open(self.stage / self.plan.files[index].name, os.O_WRONLY)
        return self.fds[index]

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        index, entry = self.plan.location[spec.name]
        data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        if len(data) != entry.end - entry.begin:
            raise MergerError(f"output {spec.name} has {len(data)} bytes, planned {entry.end - entry.begin}")
        fd, at = self._fd(index), len(self.plan.files[index].prefix) + entry.begin
        path = self.stage / self.plan.files[index].name
        while len(data):
            try:
                n = os.pwrite(fd, data, at)
            except OSError as e:
                raise MergerError(f"cannot write ({e.strerror}), {path}") from e
            data, at = data[n:], at + n

    def close(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds.clear()


def _copy_hf_files(hf_dir: Path, stage: Path) -> list[str]:
    """Copy config, tokenizer, processor, chat template and remote-code files: regular files inside hf_dir only."""
    copied = []
    for src in sorted(hf_dir.iterdir()):
        if src.is_symlink() or not src.is_file():
            continue  # a link could point anywhere on the machine; folders hold no loadable config
        if src.name.endswith(_WEIGHT_SUFFIXES) or src.name in _WEIGHT_INDEXES:
            continue
        shutil.copyfile(src, stage / src.name)
        copied.append(src.name)
    return copied


def _write_config(stage: Path, dtype_name: str | None, config_updates: dict) -> None:
    path = stage / "config.json"
    config = json.loads(path.read_text())
    if dtype_name:
        config["dtype"] = dtype_name
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype_name
    config.update(config_updates)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def finish(stage: Path, plan: Plan, hf_dir: Path, out_dtype: torch.dtype | None, manifest: dict,
           config_updates: dict | None = None) -> None:
    """Rank 0, after every rank wrote its bytes: index, config, tokenizer files, manifest, in the staging folder.

    The rename into place (`swap_into_place`) is separate so `--verify` can check the complete folder first.
    """
    if len(plan.files) > 1:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": plan.weight_map}
        (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copied = _copy_hf_files(hf_dir, stage)
    if "config.json" not in copied:
        raise MergerError(f"no config.json to copy (pass --hf_model_config_path), {hf_dir}")
    dtype_name = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
    _write_config(stage, dtype_name, config_updates or {})
    manifest = dict(manifest, output_files={f.name: f.size for f in plan.files}, copied_files=copied)
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def swap_into_place(stage: Path, target: Path, overwrite: bool) -> None:
    old = target.parent / f".{target.name}.merger-old"
    if target.exists():
        if any(target.iterdir()) and not overwrite:
            raise MergerError(f"target folder became non-empty during the merge, {target}")
        target.rename(old)
    stage.rename(target)
    shutil.rmtree(old, ignore_errors=True)

