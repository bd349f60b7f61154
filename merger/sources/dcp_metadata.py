"""Reading a torch.distributed.checkpoint `.metadata` file without letting it run code.

`.metadata` is a plain pickle, and torch's own `FileSystemReader.read_metadata()` loads it with
`pickle.load`, so a crafted file runs whatever it names. This unpickler resolves only the handful of
globals DCP itself pickles (its metadata dataclasses, torch.Size, dtypes, layouts, the checkpoint path)
and refuses everything else before any of it is called. getattr resolves to a lookup among the members of
the enums in that list, nothing more (Python 3.11.0-3.11.4 pickle an enum member as
`getattr(EnumClass, "NAME")`; see pickled_enums).
"""
from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch

from ..errors import MergerError
from .pickled_enums import GETATTR, member_lookup

METADATA_FILE = ".metadata"

_METADATA_CLASSES = {
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", n) for n in _METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Save plans kept as planner data (megatron-core's torch_dist does this): plain dataclasses and an enum.
    *(("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "TensorWriteData",
                                                            "WriteItemType")),
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
            return member_lookup(getattr(importlib.import_module(m), n) for m, n in _ALLOWED)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def load_metadata(folder: Path):
    """The `Metadata` of a DCP folder, unpickled with only DCP's own classes allowed."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401  defines _StorageInfo, which the pickle names
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
    except FileNotFoundError as e:
        raise MergerError(f"no .metadata file, {path}") from e
    except pickle.UnpicklingError as e:
        raise MergerError(f"not a DCP metadata file ({e}), {path}") from e
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle fails in many ways; all mean "damaged"
        raise MergerError(f"damaged DCP metadata file ({type(e).__name__}: {e}), {path}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise MergerError(f"not a DCP metadata file (holds a {type(metadata).__name__}), {path}")
    return metadata
