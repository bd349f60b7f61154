"""safetensors_io.read_header against hostile files: crafted lies and property-based fuzzing (hypothesis).

The seed file is written by the safetensors library itself; every mutation of it, and arbitrary bytes, must
either parse to entries that lie inside the file or raise CorruptSourceError naming the file: never another
exception, and never an allocation that follows a size the header claims rather than the file's own size.
"""
from __future__ import annotations

import json
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save

from merger.errors import CorruptSourceError
from merger.safetensors_io import header_bytes, place_tensors, read_header

SEED = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
             "c": torch.zeros(0, dtype=torch.int64)}, metadata={"format": "pt"})
_N = struct.unpack("<Q", SEED[:8])[0]
SEED_HEADER, SEED_DATA = json.loads(SEED[8:8 + _N]), SEED[8 + _N:]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def with_header(header: dict, data: bytes = SEED_DATA, edit: tuple[bytes, bytes] = (b"", b"")) -> bytes:
    """A file with `header` (its JSON text optionally edited: `edit` = (old, new)) and the seed's data."""
    text = json.dumps(header).encode().replace(*edit)
    return struct.pack("<Q", len(text)) + text + data


def check(content: bytes) -> None:
    """The property: CorruptSourceError (the corrupt kind) naming the file, or entries inside the file; memory
    bounded by the file."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        path.write_bytes(content)
        tracemalloc.start()
        try:
            start, entries, _ = read_header(str(path))
        except CorruptSourceError as e:
            assert str(e).endswith(str(path))
            return
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            # Parsed JSON may take some multiple of its text; a size the header claims must never be allocated.
            assert peak < 64 * len(content) + (1 << 20), peak
        for e in entries.values():
            assert 0 <= e.begin <= e.end and start + e.end <= len(content)


def test_fp4_headers_count_codes_as_the_safetensors_library_does():
    """torch's float4_e2m1fn_x2 holds two e2m1 codes an element; safetensors' F4 counts the codes: merger's reader
    gives a file the library wrote torch's shape, and the library reads a header merger built back as that tensor."""
    fp4 = torch.arange(24, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 3, 4)
    _, entries, _ = read_header_of(save({"w": fp4}))
    assert (entries["w"].dtype, entries["w"].shape, entries["w"].end) == (torch.float4_e2m1fn_x2, (2, 3, 4), 24)
    prefix = header_bytes(place_tensors([("w", torch.float4_e2m1fn_x2, (2, 3, 4))]))
    with tempfile.TemporaryDirectory() as d:  # load_file: the library's own `load` of bytes knows no F4
        (Path(d) / "x.safetensors").write_bytes(prefix + fp4.view(torch.uint8).numpy().tobytes())
        loaded = load_file(Path(d) / "x.safetensors")["w"]
    assert loaded.dtype == fp4.dtype and torch.equal(loaded.view(torch.uint8), fp4.view(torch.uint8))


def test_seed_is_valid():
    start, entries, metadata = read_header_of(SEED)
    assert sorted(entries) == ["a", "b", "c"] and metadata == {"format": "pt"} and start == 8 + _N


def read_header_of(content: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        path.write_bytes(content)
        return read_header(str(path))


def _entry(**change) -> dict:
    header = json.loads(json.dumps(SEED_HEADER))
    header["a"].update(change)
    return header


LIES = {
    "header length past the file": struct.pack("<Q", len(SEED)) + SEED[8:],
    "header length absurd": struct.pack("<Q", 2**63) + SEED[8:],
    "overlapping ranges": with_header(_entry() | {"b": dict(SEED_HEADER["b"], data_offsets=[16, 24])}),
    "gap between tensors": with_header(_entry(data_offsets=[8, 32], shape=[2, 3])),
    "absurd shape": with_header(_entry(shape=[2**40, 2**40], data_offsets=[0, 4 * 2**80])),
    "size disagrees with shape": with_header(_entry(shape=[3, 3])),
    "negative offset": with_header(_entry(data_offsets=[-24, 0])),
    "float offsets": with_header(_entry(data_offsets=[0.0, 24.0])),
    "infinite dimension": with_header(_entry(), edit=(b"[2, 3]", b"[1e400, 3]")),
    "boolean dimension": with_header(_entry(shape=[True, 3])),
    "5000-digit number": with_header(_entry(), edit=(b"[2, 3]", b"[" + b"9" * 5000 + b", 3]")),
    "deep nesting": struct.pack("<Q", 200_000) + b"[" * 200_000,
    "unknown dtype": with_header(_entry(dtype="F128")),
    "FP4 with an odd number of codes in a row": with_header(_entry(dtype="F4", shape=[4, 11], data_offsets=[0, 24])),
    "FP4 of no dims": with_header(_entry(dtype="F4", shape=[], data_offsets=[0, 24])),
    "entry is not an object": with_header(_entry() | {"b": [1, 2]}),
    "data section too long": with_header(SEED_HEADER, SEED_DATA + b"\0" * 8),
    "data section too short": with_header(SEED_HEADER, SEED_DATA[:-1]),
    "metadata not strings": with_header(SEED_HEADER | {"__metadata__": {"format": 1}}),
    "not JSON": struct.pack("<Q", 4) + b"\xff\xfe{}",
    "shorter than 8 bytes": b"\x01\x02",
}


@pytest.mark.parametrize("lie", list(LIES))
def test_crafted_lies_are_refused(lie):
    with pytest.raises(CorruptSourceError):
        read_header_of(LIES[lie])
    check(LIES[lie])


@SETTINGS
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(content):
    check(content)


@SETTINGS
@given(st.binary(min_size=8, max_size=8), st.binary(max_size=256))
def test_arbitrary_length_prefix_and_tail(prefix, tail):
    check(prefix + SEED[8:] + tail)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(SEED)))
def test_byte_flips_and_truncation(flips, keep):
    content = bytearray(SEED)
    for at, value in flips:
        content[at] = value
    check(bytes(content[:keep]))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
INTS = st.integers(-2**66, 2**66)


@SETTINGS
@given(st.sampled_from(["a", "b", "c", "__metadata__", "new"]),
       st.sampled_from(["dtype", "shape", "data_offsets", "extra"]),
       st.one_of(JSON, st.lists(INTS, max_size=4), st.sampled_from(["F32", "BF16", "I64", "U8", "BOOL", "F8_E4M3"])))
def test_mutated_header_fields(tensor, field, value):
    header = json.loads(json.dumps(SEED_HEADER))
    entry = header.setdefault(tensor, {})
    if isinstance(entry, dict):
        entry[field] = value
    check(with_header(header))


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), JSON, max_size=5), st.binary(max_size=64))
def test_arbitrary_json_headers(header, data):
    check(with_header(header, data))
