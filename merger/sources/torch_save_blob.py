"""Where the tensor inside one torch.save blob lies, read from the blob's zip directory and pickle alone.

torch.save writes an uncompressed zip: `<archive>/data.pkl`, a pickle saying which storage the tensor uses
and with which dtype, offset, shape and strides, and `<archive>/data/<key>`, each storage's raw bytes. DCP's
FileSystemWriter appends one such blob per chunk to a .distcp file. The zip's directory and the small
pickle give the storage's byte range and CRC-32, so the reader copies the tensor's bytes once, casting on
the way, into its batch buffer (torch.load would copy them into a fresh tensor first).

The pickle is read by an unpickler that knows only the names torch.save uses for a plain tensor and builds
nothing but a description of it: a crafted blob runs no code, as with torch.load(weights_only=True).
A tensor's pickle holds no enum, so builtins.getattr (how Python 3.11.0-3.11.4 pickle enum members, see
pickled_enums) stays refused here like every other global.
"""
from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass, replace
from typing import BinaryIO

import torch

from ..catalog import ZipRecord
from ..errors import MergerError
from .file_reads import geometry
from .zip_records import ZipRecordError, open_archive, storage_record


class BlobError(ValueError):
    """The bytes are not a torch.save blob of one plain tensor (the caller names the file)."""


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    metadata=None) -> _TensorRef:
    """Stands in for torch._utils._rebuild_tensor_v2: records the arguments, builds nothing."""
    if not isinstance(storage, _Storage):
        raise BlobError("tensor without a storage")
    return _TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _storage_dtype(name: str) -> torch.dtype:
    """`FloatStorage` -> torch.float32: torch.save names a storage by its legacy typed-storage class."""
    cls = getattr(torch, name, None) if name.endswith("Storage") else None
    if not (isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage)):
        raise BlobError(f"refusing to load global torch.{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; its dtype is all that is read here
        return cls.dtype


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict  # the (empty) backward hooks
        if module == "torch":
            return _storage_dtype(name)
        raise BlobError(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise BlobError(f"unexpected storage reference {pid!r:.80}")
        return _Storage(pid[2], pid[1], pid[4])


def tensor_in_blob(blob: BinaryIO, length: int) -> tuple[torch.Tensor, ZipRecord]:
    """The tensor saved in `blob` (a file of `length` bytes) as a data-less view with its geometry, and the
    record of its storage (its start relative to the blob)."""
    try:
        archive, entries = open_archive(blob)
        if "data.pkl" not in entries:
            raise BlobError("no data.pkl record")
        ref = _Unpickler(io.BytesIO(archive.read(entries["data.pkl"]))).load()
    except (BlobError, MergerError):  # MergerError: the file shrank while being read
        raise
    except Exception as e:  # noqa: BLE001 - damaged zips and pickles fail in many ways; all mean "not a blob"
        raise BlobError(f"not a torch.save blob ({type(e).__name__}: {e})") from e
    if not isinstance(ref, _TensorRef):
        raise BlobError(f"holds a {type(ref).__name__}, not a tensor")
    storage = ref.storage
    info = entries.get(f"data/{storage.key}")
    if info is None:
        raise BlobError(f"storage {storage.key} is missing")
    try:
        record = storage_record(blob, info)
    except ZipRecordError as e:
        raise BlobError(str(e)) from e
    nbytes = storage.numel * storage.dtype.itemsize
    if record.size != nbytes or record.start + record.size > length:
        raise BlobError(f"storage {storage.key} holds {record.size} bytes, not {storage.numel} {storage.dtype} "
                        f"elements")
    if len(ref.size) != len(ref.stride) or any(s < 0 for s in (*ref.size, *ref.stride)) or ref.offset < 0:
        raise BlobError(f"tensor has bad geometry {ref.size} / {ref.stride}")
    last = ref.offset + sum((n - 1) * st for n, st in zip(ref.size, ref.stride)) if all(ref.size) else -1
    if last >= storage.numel:
        raise BlobError(f"tensor reaches element {last} of a {storage.numel}-element storage")
    used = (ref.offset * storage.dtype.itemsize, (last + 1) * storage.dtype.itemsize) if last >= 0 else (0, 0)
    view = geometry(storage.dtype, ref.size, ref.stride, ref.offset, storage.numel)
    return view, replace(record, used=used)
