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

from ..engine.memory import start_writeback
from ..engine.plan import Plan, Runs
from ..errors import MergerError
from ..hf_folder import INDEX, files_to_copy
from ..mapping.steps import OutputSpec
from ..units import format_size
from .write_turns import write_at

MANIFEST = "merge_manifest.json"


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a merge that cannot fit: cheaper than failing with ENOSPC after minutes of streaming."""
    try:
        st = os.statvfs(folder)
    except OSError as e:
        raise MergerError(f"cannot check free space ({e.strerror}), {folder}") from e
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise MergerError(f"not enough free space for the merged model: it needs {format_size(needed)}, "
                          f"{format_size(free)} are free, {folder}")


def prepare_files(stage: Path, plan: Plan, keep: frozenset[str] = frozenset()) -> None:
    """Create every output file at its final size with its header in place (rank 0, before streaming).

    Files named in `keep` are finished files a resumed merge reuses: they are left exactly as they are.
    Growing each file to its final size up front also meets a file size limit (EFBIG) before any streaming.
    """
    if stage.exists() and not keep:
        shutil.rmtree(stage)
    stage.mkdir(parents=True, exist_ok=True)
    for f in plan.files:  # a resumed merge's unfinished files: written anew, so their space counts as free
        if f.name not in keep:
            (stage / f.name).unlink(missing_ok=True)
    check_free_space(stage, sum(f.size for f in plan.files if f.name not in keep))
    for f in plan.files:
        if f.name in keep:
            continue
        path = stage / f.name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # side files may sit in a subfolder
            with open(path, "wb") as out:
                out.write(f.prefix)
                out.truncate(f.size)
        except OSError as e:
            raise MergerError(f"cannot write the merged model ({e.strerror}), {path}") from e


# Bytes per pwrite. Linux sizes the page-cache folios a write creates by its length; folios of 512 KiB and up
# must come from contiguous free memory, and filling new ones ran at 0.6-1.0 GB/s on this project's VM against
# 4-5 GB/s for writes of 128-256 KiB (2.2 GB into a new file; cp, which splices page by page, gets the latter).
WRITE_CHUNK = 256 << 10


class FileSink:
    """Writes each output tensor's bytes at its planned offset; several ranks write one file side by side."""

    def __init__(self, stage: Path, plan: Plan, skip: frozenset[str] = frozenset(), take_turns: bool = False):
        self.stage, self.plan = stage, plan
        self.take_turns = take_turns  # with the other ranks of this host (write_turns.py)
        self.fds: dict[int, int] = {}
        # Files a resumed merge reuses: their bytes are already right, so outputs landing there are dropped.
        self.skip = {i for i, f in enumerate(plan.files) if f.name in skip}

    def _fd(self, index: int) -> int:
        if index not in self.fds:
            self.fds[index] = os.open(self.stage / self.plan.files[index].name, os.O_WRONLY)
        return self.fds[index]

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        entry = self.plan.location[spec.name][1]
        size = tensor.numel() * tensor.element_size()
        if size != entry.end - entry.begin:
            raise MergerError(f"output {spec.name} has {size} bytes, planned {entry.end - entry.begin}")
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        """Write `piece`'s bytes into output `spec` where `runs` (plan.py) puts them: one write per run."""
        index, entry = self.plan.location[spec.name]
        if index in self.skip:
            return
        data = memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
        item, planned = piece.element_size(), entry.end - entry.begin
        last = runs.start + sum((n - 1) * s for n, s in zip(runs.outer, runs.strides)) + runs.length
        if len(data) != runs.count * runs.length * item or (runs.count and last * item > planned):
            raise MergerError(f"output {spec.name}: {len(data)} bytes in runs ending at byte {last * item} "
                              f"do not fit its {planned} planned bytes")
        fd, base = self._fd(index), len(self.plan.files[index].prefix) + entry.begin
        size = runs.length * item
        for k, start in enumerate(runs.starts()):
            self._write(fd, index, data[k * size:(k + 1) * size], base + start * item)

    def _write(self, fd: int, index: int, data: memoryview, at: int) -> None:
        while len(data):
            try:
                n = write_at(fd, data[:WRITE_CHUNK], at, self.take_turns)
            except OSError as e:
                raise MergerError(f"cannot write the merged model ({e.strerror}), "
                                  f"{self.stage / self.plan.files[index].name}") from e
            data, at = data[n:], at + n

    def sync(self, indices) -> None:
        """Flush and close the files this rank wrote among `indices` (they are complete: none writes them again)."""
        for index in indices:
            fd = self.fds.pop(index, None)
            if fd is None:
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                raise MergerError(f"cannot write the merged model ({e.strerror}), "
                                  f"{self.stage / self.plan.files[index].name}") from e
            finally:
                os.close(fd)

    def start_writeback(self) -> None:
        """Let the disk take what was written so far while streaming goes on, so the final fsync is short."""
        for fd in self.fds.values():
            start_writeback(fd)

    def close(self) -> None:
        self.sync(list(self.fds))


def _write_into(stage: Path, name: str, data: bytes) -> None:
    """A write into the staging folder; a failure (ENOSPC, EFBIG, EDQUOT...) names the file being written."""
    try:
        (stage / name).write_bytes(data)
    except OSError as e:
        raise MergerError(f"cannot write the merged model ({e.strerror}), {stage / name}") from e


def _copy_hf_files(hf_dir: Path, stage: Path) -> list[str]:
    copied = []
    for src in files_to_copy(hf_dir):
        try:
            data = src.read_bytes()  # config and tokenizer files: small
        except OSError as e:
            raise MergerError(f"cannot read ({e.strerror}), {src}") from e
        _write_into(stage, src.name, data)
        copied.append(src.name)
    return copied


def _write_config(stage: Path, dtype_name: str | None, config_updates: dict,
                  config_removals: tuple[str, ...]) -> None:
    path = stage / "config.json"
    config = json.loads(path.read_text())
    if dtype_name:
        config["dtype"] = dtype_name
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype_name
    config.update(config_updates)
    for key in config_removals:
        config.pop(key, None)
    _write_into(stage, "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def finish(stage: Path, plan: Plan, hf_dir: Path | None, out_dtype: torch.dtype | None, manifest: dict,
           config_updates: dict | None = None, extra_files: dict[str, str] | None = None,
           list_added: bool = False, config_removals: tuple[str, ...] = ()) -> None:
    """Rank 0, after every rank wrote its bytes: index, config (`config_updates` set, `config_removals`
    deleted), tokenizer files, extra files (relative path -> text, e.g. an adapter's config), manifest, in the
    staging folder.

    `list_added`: the output joins a folder of the source's (target.py), so the manifest lists what it adds there,
    which is all a later merge may replace. The move into place (`target.place`) is separate so that `--verify`
    can check the complete folder first.
    """
    if len(plan.model_files) > 1:
        total = sum(f.size - len(f.prefix) for f in plan.model_files)
        index = {"metadata": {"total_size": total}, "weight_map": plan.weight_map}
        _write_into(stage, INDEX, (json.dumps(index, indent=2) + "\n").encode())
    copied = []
    if hf_dir is not None:  # None: the target is no HF model (an adapter folder): no config to complete
        copied = _copy_hf_files(hf_dir, stage)
        if "config.json" not in copied:
            raise MergerError(f"no config.json to copy (pass --hf_model_config_path), {hf_dir}")
        dtype_name = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
        _write_config(stage, dtype_name, config_updates or {}, config_removals)
    for name, text in (extra_files or {}).items():
        (stage / name).parent.mkdir(parents=True, exist_ok=True)
        _write_into(stage, name, text.encode())
    manifest = dict(manifest, copied_files=copied, complete=True)
    if list_added:
        manifest["added_files"] = sorted(p.name for p in stage.iterdir() if not p.name.startswith(MANIFEST))
    manifest.setdefault("output_files", {f.name: {"size": f.size} for f in plan.files})
    write_manifest(stage, manifest)


def write_manifest(stage: Path, manifest: dict) -> None:
    """Replace the manifest atomically: a crash leaves the old one or the new one, never half of one."""
    tmp = stage / (MANIFEST + ".tmp")
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, stage / MANIFEST)
    except OSError as e:
        raise MergerError(f"cannot write the merge manifest ({e.strerror}), {tmp}") from e
