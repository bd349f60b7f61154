"""Reading a torch.distributed.checkpoint `.metadata` file without letting it run code.

`.metadata` is a plain pickle, and torch's own `FileSystemReader.read_metadata()` loads it with
`pickle.load`, so a crafted file runs whatever it names. This unpickler resolves only the handful of
globals DCP itself pickles (its metadata dataclasses, as merger's stand-ins from dcp_classes; torch.Size,
dtypes, layouts, the checkpoint path) and refuses everything else before any of it is called. getattr
resolves to a lookup among the members of the enums in that list, nothing more (Python 3.11.0-3.11.4
pickle an enum member as `getattr(EnumClass, "NAME")`; see pickled_enums).
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from ..errors import CorruptSourceError, SourceError
from ..io import read_whole
from .dcp_classes import TORCH_NAMES, Metadata, TensorStorageMetadata
from .dcp_compact import NOT_READ, CompactRecords, Rows, rewrite
from .pickled_enums import GETATTR, member_lookup

METADATA_FILE = ".metadata"

# Beside DCP's own classes (TORCH_NAMES), the globals its pickles name, resolved by import as named.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in GETATTR:
            return member_lookup(TORCH_NAMES.values())
        if (module, name) in TORCH_NAMES:
            return TORCH_NAMES[module, name]
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _read(path: Path) -> bytearray:
    """The whole `.metadata`, as a bytearray (dcp_compact edits it in place), local or in a bucket."""
    try:
        return read_whole(str(path))
    except FileNotFoundError as e:
        raise SourceError(f"no .metadata file, {path}") from e
    except OSError as e:
        raise SourceError(f"cannot read DCP metadata file ({e}), {path}") from e


def _unpickled(stream: bytes, stand_in=None):
    unpickler = _RestrictedUnpickler(io.BytesIO(stream))
    if stand_in is not None:  # our own persistent ids (dcp_compact); without it, one in the file is refused
        unpickler.persistent_load = stand_in
    return unpickler.load()


def _rows_in_place(metadata, runs: int) -> bool:
    """Whether the unpickled metadata holds each cut run once, where runs belong: in a TensorStorageMetadata's
    chunks or as a key of `storage_data` (a run found anywhere else, or twice: the plain load must decide)."""
    found = [c for m in metadata.state_dict_metadata.values()
             if isinstance(m, TensorStorageMetadata) and isinstance(m.chunks, list) for c in m.chunks
             if isinstance(c, Rows)]
    if isinstance(metadata.storage_data, dict):
        found += [k for k in metadata.storage_data if isinstance(k, Rows)]
    return len(found) == len(set(found)) == runs


def load_compact(folder: Path):
    """(Metadata, CompactRecords): the `.metadata` of a DCP folder with the runs of chunks and storage entries as
    arrays (dcp_compact); each run is a `Rows` in the tensor's `chunks` list or a key of `storage_data` (its value
    None); megatron-core's `all_local_plans`, where skipped unread, is NOT_READ. Unpickled with only DCP's own
    classes allowed, as load_metadata."""
    path = folder / METADATA_FILE
    walked = _walked(_read(path))
    if walked is None:  # the plain load decides, with its errors; the walk edited the bytes it had
        return _plain(_read(path), path), CompactRecords()
    return walked


def _walked(data: bytearray):
    """load_compact's (Metadata, CompactRecords), or None where the walk does not take the pickle."""
    try:
        stream, records, stand_in, runs, skipped = rewrite(data)
        del data  # the arrays are what the unpickler needs: 402 MB at 671B, freed (no caller keeps a reference)
        metadata = _unpickled(stream, stand_in)
        in_place = _is_metadata(metadata) and _rows_in_place(metadata, runs) \
            and (vars(metadata).get("all_local_plans") is NOT_READ) == skipped
        return (metadata, records) if in_place else None
    except Exception:  # noqa: BLE001 - anything the walk does not take, the plain load decides
        return None


def _is_metadata(metadata) -> bool:
    return isinstance(metadata, Metadata) and isinstance(getattr(metadata, "state_dict_metadata", None), dict)


def _plain(data: bytes, path: Path):
    try:
        metadata = _unpickled(data)
    except pickle.UnpicklingError as e:
        raise CorruptSourceError(f"not a DCP metadata file ({e}), {path}") from e
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle fails in many ways; all mean "damaged"
        raise CorruptSourceError(f"damaged DCP metadata file ({type(e).__name__}: {e}), {path}") from e
    if not _is_metadata(metadata):
        raise CorruptSourceError(f"not a DCP metadata file (holds a {type(metadata).__name__}), {path}")
    return metadata


def load_metadata(folder: Path):
    """The `Metadata` of a DCP folder (dcp_classes' stand-in), unpickled with only DCP's own classes allowed:
    every chunk and storage entry an object, as the pickle holds them."""
    metadata, records = load_compact(folder)
    # A damaged pickle may leave out any field (its BUILD state is a dict like any other): what is not there, or
    # not a list or dict, is left as it was for the caller's checks, as load_chunk_table's are.
    for meta in metadata.state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata) and isinstance(getattr(meta, "chunks", None), list):
            meta.chunks = [c for item in meta.chunks
                           for c in (records.expanded(item) if isinstance(item, Rows) else [item])]
    if isinstance(getattr(metadata, "storage_data", None), dict):
        metadata.storage_data = dict(pair for key, value in metadata.storage_data.items()
                                     for pair in (records.expanded(key) if isinstance(key, Rows) else [(key, value)]))
    return metadata
