"""One file named by string (a local path or an object URL), read whole or in part through its storage."""
from __future__ import annotations

import os

from .locations import is_remote, storage_of


def file_size(file: str) -> int:
    storage, key = storage_of(file)
    return storage.size(key)


def exists(file: str) -> bool:
    storage, key = storage_of(file)
    return storage.kind(key) is not None


def is_file(file: str) -> bool:
    storage, key = storage_of(file)
    return storage.kind(key) == "file"


def read_range(file: str, start: int = 0, length: int | None = None) -> bytes:
    """Bytes [start, start + length) of the file, to its end when `length` is None; fewer where it ends."""
    storage, key = storage_of(file)
    return storage.read(key, start, length)


def read_whole(file: str) -> bytearray:
    """The whole file in a bytearray of its own (a reader that edits it in place), read straight into it locally."""
    if not is_remote(file):
        with open(file, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            del data[f.readinto(data):]
            return data
    storage, key = storage_of(file)
    return bytearray(storage.read(key))


def file_identity(file: str) -> dict[str, int | str]:
    """What says the file is still the one read (LocalStorage.identity, ObjectStorage.identity)."""
    storage, key = storage_of(file)
    return storage.identity(key)
