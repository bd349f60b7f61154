"""Paths as users give them, turned into locations: a local folder is a `pathlib.Path`, an object URL
(`s3://bucket/run/step`) an `ObjectPath` that answers the questions sources ask of a Path the same way.

Catalogs name their files by string (`str(location / name)`); `storage_of` finds the Storage holding one.
"""
from __future__ import annotations

import fnmatch
import os
import posixpath
import re
from pathlib import Path, PurePosixPath

from ..errors import MergerError
from .local import LocalStorage
from .storage import Storage

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.S)
OBJECT_SCHEMES = ("s3", "gs", "gcs", "az", "abfs")


def _split(text: str) -> tuple[str, str] | None:
    """(scheme, bucket/key) of an object URL; None for a local path (file:// included)."""
    m = _URL.fullmatch(text)
    if m is None or m.group(1).lower() == "file":
        return None
    scheme = m.group(1).lower()
    if scheme not in OBJECT_SCHEMES:
        raise MergerError(f"{scheme}:// paths are not supported (local folders, file://, and "
                          f"{', '.join(s + '://' for s in OBJECT_SCHEMES)} are), {text}")
    key = posixpath.normpath("/" + m.group(2)).lstrip("/")
    if not key:
        raise MergerError(f"the URL names no bucket, {text}")
    return scheme, key


def is_remote(path: str | os.PathLike) -> bool:
    return isinstance(path, ObjectPath) or (isinstance(path, str) and _split(path) is not None)


def location(path: str | os.PathLike) -> Path | ObjectPath:
    """Where a path argument points: a Path, or an ObjectPath for an object URL."""
    if isinstance(path, ObjectPath):
        return path
    text = os.fspath(path)
    parts = _split(text)
    if parts is None:
        return Path(text.removeprefix("file://"))
    return ObjectPath(*parts)


_OBJECT_STORAGES: dict[str, Storage] = {}  # scheme -> its storage: one client per process


def _object_storage(scheme: str, url: str) -> Storage:
    """The storage of `scheme` (`url`, the first path asked for, names what needed it in an error)."""
    if scheme not in _OBJECT_STORAGES:
        from .object_store import ObjectStorage  # fsspec is imported only by merges that read a bucket

        _OBJECT_STORAGES[scheme] = ObjectStorage(scheme, url)
    return _OBJECT_STORAGES[scheme]


LOCAL = LocalStorage()


def reads_objects() -> bool:
    """Whether this process has named any object in a bucket (a merge of local files never has)."""
    return bool(_OBJECT_STORAGES)


def fetched_bytes() -> int:
    """Bytes this process has fetched from object storage so far (bytes read ahead included)."""
    return sum(storage.fetched for storage in _OBJECT_STORAGES.values())


def storage_of(file: str) -> tuple[Storage, str]:
    """The storage holding `file` (a local path or an object URL) and its key there."""
    parts = _split(file) if "://" in file else None
    if parts is None:
        return LOCAL, file
    return _object_storage(parts[0], file), parts[1]


def relative_name(file: str, root: str | os.PathLike) -> str:
    """`file`'s name below the folder `root`, as a manifest records it."""
    if is_remote(file):
        return posixpath.relpath(_split(file)[1], _split(str(root))[1])
    return os.path.relpath(file, root)


class ObjectPath:
    """An object key or prefix in a bucket, with the part of pathlib's interface sources use."""

    __slots__ = ("scheme", "key")

    def __init__(self, scheme: str, key: str):
        self.scheme, self.key = scheme, key.strip("/")

    @property
    def storage(self) -> Storage:
        return _object_storage(self.scheme, str(self))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and (self.scheme, self.key) == (other.scheme, other.key)

    def __lt__(self, other: ObjectPath) -> bool:
        return self.key < other.key

    def __hash__(self) -> int:
        return hash((self.scheme, self.key))

    def __truediv__(self, name: str | os.PathLike) -> ObjectPath:
        return ObjectPath(self.scheme, posixpath.normpath(posixpath.join(self.key, os.fspath(name))))

    joinpath = __truediv__

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def stem(self) -> str:
        return PurePosixPath(self.key).stem

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def parent(self) -> ObjectPath:
        parent = posixpath.dirname(self.key)
        return ObjectPath(self.scheme, parent) if parent else self

    @property
    def parents(self) -> list[ObjectPath]:
        out, at = [], self
        while at.parent != at:
            at = at.parent
            out.append(at)
        return out

    def resolve(self) -> ObjectPath:
        return self  # keys hold no links

    absolute = resolve

    def relative_to(self, other: ObjectPath) -> Path:
        if other != self and other not in self.parents:
            raise ValueError(f"{self} is not below {other}")
        return Path(posixpath.relpath(self.key, other.key))

    def exists(self) -> bool:
        return self.storage.kind(self.key) is not None

    def is_file(self) -> bool:
        return self.storage.kind(self.key) == "file"

    def is_dir(self) -> bool:
        return self.storage.kind(self.key) == "dir"

    def iterdir(self) -> list[ObjectPath]:
        return [self / e.name for e in self.storage.list(self.key)]

    def glob(self, pattern: str) -> list[ObjectPath]:
        if "/" in pattern:
            raise ValueError(f"only one folder level is globbed in a bucket: {pattern}")
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def read_bytes(self) -> bytes:
        return self.storage.read(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)
