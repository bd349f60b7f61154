"""The tensor inside one torch.save blob, as a view of the bytes where they lie, without copying them.

torch.save writes an uncompressed zip: `<archive>/data.pkl`, a pickle saying which storage the tensor uses
and with which dtype, offset, shape and strides, and `<archive>/data/<key>`, each storage's raw bytes. DCP's
FileSystemWriter appends one such blob per chunk to a .distcp file. The zip's directory and the small
pickle give the storage's byte range, so a reader that has the file mapped can view the tensor in place and
copy it once, casting on the way, into its batch buffer (torch.load would copy it into a fresh tensor first).

The pickle is read by an unpickler that knows only the names torch.save uses for a plain tensor and builds
nothing but a description of it: a crafted blob runs no code, as with torch.load(weights_only=True).
A tensor's pickle holds no enum, so builtins.getattr (how Python 3.11.0-3.11.4 pickle enum members, see
pickled_enums) stays refused here like every other global.
"""
from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass

import torch

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


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


class _ViewFile(io.RawIOBase):
    """A read-only file over a memoryview: zipfile reads the directory through it without copying the blob."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, len(self.view))[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        chunk = self.view[self.pos:self.pos + len(buffer)]
        memoryview(buffer).cast("B")[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def _describe(blob: memoryview) -> tuple[_TensorRef, int]:
    """The tensor the blob holds and where its storage's bytes start, relative to the blob."""
    try:
        archive = zipfile.ZipFile(_ViewFile(blob))  # reads the directory at the end, not the data
        records = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        if records.get("byteorder") is not None and archive.read(records["byteorder"]) != b"little":
            raise BlobError("saved big-endian")
        if "data.pkl" not in records:
            raise BlobError("no data.pkl record")
        ref = _Unpickler(io.BytesIO(archive.read(records["data.pkl"]))).load()
    except BlobError:
        raise
    except Exception as e:  # noqa: BLE001 - damaged zips and pickles fail in many ways; all mean "not a blob"
        raise BlobError(f"not a torch.save blob ({type(e).__name__}: {e})") from e
    if not isinstance(ref, _TensorRef):
        raise BlobError(f"holds a {type(ref).__name__}, not a tensor")
    info = records.get(f"data/{ref.storage.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        raise BlobError(f"storage {ref.storage.key} is missing or compressed")
    try:
        if info.header_offset < 0:
            raise struct.error("negative offset")
        signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(blob, info.header_offset)
    except struct.error as e:
        raise BlobError(f"storage {ref.storage.key} has no local zip header") from e
    if signature != _LOCAL_SIGNATURE:
        raise BlobError(f"storage {ref.storage.key} has no local zip header")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if info.file_size != ref.storage.numel * ref.storage.dtype.itemsize or start + info.file_size > len(blob):
        raise BlobError(f"storage {ref.storage.key} holds {info.file_size} bytes, not {ref.storage.numel} "
                        f"{ref.storage.dtype} elements")
    return ref, start


def tensor_in_blob(blob: memoryview) -> torch.Tensor:
    """A view of the tensor saved in `blob` (writable memory, e.g. a private file mapping; never written)."""
    ref, start = _describe(blob)
    storage = ref.storage
    if len(ref.size) != len(ref.stride) or any(s < 0 for s in (*ref.size, *ref.stride)) or ref.offset < 0:
        raise BlobError(f"tensor has bad geometry {ref.size} / {ref.stride}")
    last = ref.offset + sum((n - 1) * st for n, st in zip(ref.size, ref.stride)) if all(ref.size) else -1
    if last >= storage.numel:
        raise BlobError(f"tensor reaches element {last} of a {storage.numel}-element storage")
    nbytes = storage.numel * storage.dtype.itemsize
    flat = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(storage.dtype).as_strided(ref.size, ref.stride, ref.offset)
