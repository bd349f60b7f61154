"""Reading a torch.distributed.checkpoint `.metadata` file without letting it run code.

`.metadata` is a plain pickle, and torch's own `FileSystemReader.read_metadata()` loads it with
`pickle.load`, so a crafted file runs whatever it names. This unpickler resolves only the handful of
globals DCP itself pickles (its metadata dataclasses, as merger's stand-ins from dcp_classes; torch.Size,
dtypes, layouts, the checkpoint path) and refuses everything else before any of it is called. getattr
resolves to a lookup among the members of the enums in that list, nothing more (Python 3.11.0-3.11.4
pickle an enum member as `getattr(EnumClass, "NAME")`; see pickled_enums).
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch

from ..errors import MergerError
from ..io import open_binary
from .dcp_classes import TORCH_NAMES, Metadata
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


def load_metadata(folder: Path):
    """The `Metadata` of a DCP folder (dcp_classes' stand-in), unpickled with only DCP's own classes allowed."""
    path = folder / METADATA_FILE
    try:
        with open_binary(str(path)) as f:
            metadata = _RestrictedUnpickler(f).load()
    except FileNotFoundError as e:
        raise MergerError(f"no .metadata file, {path}") from e
    except pickle.UnpicklingError as e:
        raise MergerError(f"not a DCP metadata file ({e}), {path}") from e
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle fails in many ways; all mean "damaged"
        raise MergerError(f"damaged DCP metadata file ({type(e).__name__}: {e}), {path}") from e
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise MergerError(f"not a DCP metadata file (holds a {type(metadata).__name__}), {path}")
    return metadata
