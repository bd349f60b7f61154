"""merger's stand-ins for the torch classes a DCP `.metadata` pickle names.

A `.metadata` is a pickle of torch.distributed.checkpoint's own dataclasses. Importing any of them imports
the package torch.distributed.checkpoint, and with it DTensor's sharding rules and sympy: about half a
second of every DCP and Megatron torch_dist merge, for classes merger only reads fields of. The restricted
unpickler (dcp_metadata) resolves the names listed in TORCH_NAMES to the classes here instead: the same
class names and fields, no behaviour.

The files are written by torch's real classes across torch versions, which added fields over time. A stand-in
takes whatever state the pickle gives (BUILD fills its `__dict__`, as for torch's dataclasses); a field an
older torch did not write has a class-level default here, so the readers see the same attributes either way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"


@dataclass
class ChunkStorageMetadata:
    """One saved box of a tensor: its offsets into the global tensor and its sizes."""

    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(enum.Enum):
    """How torch pickles a tensor's memory format (a torch.memory_format cannot be pickled). Values as torch's."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


@dataclass
class TensorProperties:
    dtype: torch.dtype
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __setstate__(self, state) -> None:
        # torch's __getstate__ pickles a 5-tuple, with the memory format encoded.
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        if encoding not in _MEMORY_FORMATS:
            raise ValueError(f"unknown memory format encoding {encoding!r}")
        self.memory_format = _MEMORY_FORMATS[encoding]


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A non-tensor entry (a torch.save'd object)."""


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: tuple[str, ...] | list[str] = ()


@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None  # FileSystemWriter's: MetadataIndex -> _StorageInfo
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """The key of `storage_data`: equal and hashed on (fqn, offset) as torch's; `index` is only a search hint."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(default=None, hash=False, compare=False)


@dataclass
class _StorageInfo:
    """Where FileSystemWriter put one chunk: a byte range of a file beside `.metadata`."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None  # newer torch; it pickles the field only when set


# A save plan, as megatron-core's torch_dist keeps in the planner data.
class WriteItemType(enum.Enum):
    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: Any = None
    tensor_data: TensorWriteData | None = None


@dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


# The (module, name) a torch pickle gives each class -> its stand-in.
TORCH_NAMES: dict[tuple[str, str], type] = {
    **{(_METADATA, c.__name__): c for c in (Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata,
                                            ChunkStorageMetadata, TensorProperties, StorageMeta,
                                            _MEM_FORMAT_ENCODING)},
    (_FILESYSTEM, "_StorageInfo"): _StorageInfo,
    **{(_PLANNER, c.__name__): c for c in (SavePlan, WriteItem, TensorWriteData, WriteItemType)},
}
