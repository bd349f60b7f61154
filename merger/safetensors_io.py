"""The safetensors format, small and strict: headers computed before any data exists, and a validating reader.

Each tensor's range in the data section depends only on the dtypes and shapes before it, and the header only on
names, dtypes and shapes: the planner places every output's range (place_tensors), the output side writes each
file's header (header_bytes, once per file: output/safetensors_layout.py), and writers on any rank put each
tensor's bytes at `data_start + begin` with os.pwrite.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import CorruptSourceError, MergerError, SourceError
from .io import file_size, read_range

# two e2m1 codes a byte (DeepSeek-V4's FP4 experts may be stored so); torch counts the bytes, safetensors' "F4" the
# codes, so a header's last dim is twice the tensor's (header_shape, tensor_shape)
FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",  # DeepSeek-V4's block scales: powers of two
    **({FP4_X2: "F4"} if FP4_X2 is not None else {}),
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}

# A header is JSON of names and shapes; 100 MB is what the reference implementation accepts at most.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # relative to the start of the data section
    end: int


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def header_shape(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """A tensor's shape as a safetensors header gives it: FP4_X2's last dim in codes, two a byte."""
    return (*shape[:-1], shape[-1] * 2) if dtype == FP4_X2 and shape else tuple(shape)


def tensor_shape(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...] | None:
    """The shape torch gives a tensor that a safetensors header says is `shape` of `dtype` (None: no such tensor,
    an FP4 one of an odd number of codes in a row or of no dims)."""
    if dtype != FP4_X2:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // 2) if shape and shape[-1] % 2 == 0 else None


def place_tensors(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[TensorEntry]:
    """Each tensor's byte range in a safetensors data section, packed from 0 in the order given; an error for a dtype
    safetensors cannot store. The ranges depend on no header: a plan fixes them before any header exists."""
    placed, offset = [], 0
    for name, dtype, shape in entries:
        if dtype not in DTYPE_NAMES:
            raise MergerError(f"dtype {dtype} cannot be stored in safetensors, tensor {name}")
        size = nbytes_of(shape, dtype)
        placed.append(TensorEntry(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    return placed


def header_bytes(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes before a safetensors file's data section (the header's length, then its JSON) for `entries`, as
    place_tensors laid them out, in that order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    for e in entries:
        header[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(header_shape(e.shape, e.dtype)),
                          "data_offsets": [e.begin, e.end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the reference writer aligns the data section to 8 bytes
    return struct.pack("<Q", len(text)) + text


def _strict_int(value: object) -> int:
    """JSON integers only: not true/false, not 1.5 or 1e400 (int() would round them or overflow)."""
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


def read_header(path: str, start: int = 0) -> tuple[int, dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate a safetensors header: (data_start, entries by name, metadata).

    `start` is where the safetensors bytes begin (a DCP file in safetensors format may put other entries before
    them); they run to the end of the file. Refuses, before allocating anything for data, a header length past
    the file, offsets that are not contiguous from 0, sizes that disagree with dtype and shape, and a data
    section of the wrong length.
    """
    try:
        size = file_size(path)
        prefix = read_range(path, start, 8)
        if len(prefix) < 8:
            raise CorruptSourceError(f"not a safetensors file (shorter than 8 bytes), {path}")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or start + 8 + n > size:
            raise CorruptSourceError(f"safetensors header length {n} runs past the file ({size} bytes), {path}")
        raw = read_range(path, start + 8, n)
    except OSError as e:
        raise SourceError(f"cannot read {e.strerror.lower() if e.strerror else e}, {path}") from e
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, 5000-digit numbers, deep nesting
        raise CorruptSourceError(f"safetensors header is not valid JSON ({type(e).__name__}), {path}") from e
    if not isinstance(header, dict):
        raise CorruptSourceError(f"safetensors header is not a JSON object, {path}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptSourceError(f"safetensors __metadata__ must map strings to strings, {path}")
    entries = {}
    for name, info in header.items():
        try:
            dtype = DTYPES_BY_NAME[info["dtype"]]
            shape = tensor_shape(tuple(_strict_int(s) for s in info["shape"]), dtype)
            begin, end = (_strict_int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSourceError(f"safetensors entry {name!r} is malformed, {path}") from e
        if shape is None:
            raise CorruptSourceError(f"safetensors entry {name!r} is FP4 (two codes a byte) with an odd number of "
                                     f"codes in its last dim, {path}")
        if any(s < 0 for s in shape) or not 0 <= begin <= end:
            raise CorruptSourceError(f"safetensors entry {name!r} has a negative size or offset, {path}")
        if end - begin != nbytes_of(shape, dtype):
            raise CorruptSourceError(f"safetensors entry {name!r} is {end - begin} bytes but its shape needs "
                                     f"{nbytes_of(shape, dtype)}, {path}")
        entries[name] = TensorEntry(name, dtype, shape, begin, end)
    expected = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != expected:
            raise CorruptSourceError(f"safetensors entry {e.name!r} overlaps or leaves a gap at byte {e.begin}, "
                                     f"{path}")
        expected = e.end
    if start + 8 + n + expected != size:
        raise CorruptSourceError(f"safetensors data section is {size - start - 8 - n} bytes but the header "
                                 f"describes {expected}, {path}")
    return start + 8 + n, entries, metadata

