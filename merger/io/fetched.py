"""Small files of a folder in a bucket (an HF config folder: config, tokenizer, chat template) copied into a
local folder, so that transformers reads them and the output copies them as it does a local config folder."""
from __future__ import annotations

from functools import cache
from pathlib import Path

from ..errors import SourceError
from .locations import ObjectPath
from .scratch_folders import copying, scratch_folder

_LARGEST = 64 << 20  # a file past this is no config or tokenizer: not fetched
_ORIGINS: dict[Path, ObjectPath] = {}  # each local copy -> the folder it was fetched from


def origin(folder: Path) -> Path | ObjectPath:
    """Where a folder's files come from: the bucket's folder for a local copy fetched here, else itself."""
    return _ORIGINS.get(folder, folder)


@cache
def fetched_folder(folder: ObjectPath, wanted) -> Path:
    """A local folder holding the files of `folder` (its top level) that `wanted(name)` accepts; removed when the
    process ends. Fetched once per process."""
    if not folder.is_dir():
        raise SourceError(f"HF config folder does not exist, {folder}")
    local = scratch_folder("merger-fetched-")
    storage = folder.storage
    for entry in storage.list(folder.key):
        if entry.is_dir or not wanted(entry.name):
            continue
        key = f"{folder.key}/{entry.name}"
        if storage.size(key) > _LARGEST:
            continue
        data = storage.read(key)
        with copying(f"{folder}/{entry.name}", local / entry.name):
            (local / entry.name).write_bytes(data)
    _ORIGINS[local] = folder
    return local
