"""dcp_metadata.load_metadata and dcp_chunk_table.load_chunk_table against hostile and damaged `.metadata` files
(hypothesis).

The seed is written by torch.distributed.checkpoint itself (a single-process dcp.save). Every mutation of
it, and arbitrary bytes, must either load to a `Metadata` (merger's stand-in for DCP's) or raise
MergerError naming the file: never another exception, and never a global outside DCP's metadata classes
(the restricted unpickler refuses those before calling anything).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from merger.errors import MergerError
from merger.sources.dcp_chunk_table import load_chunk_table
from merger.sources.dcp_classes import Metadata
from merger.sources.dcp_metadata import load_metadata

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def seed() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, checkpoint_id=d)
        return (Path(d) / ".metadata").read_bytes()


def check(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / ".metadata").write_bytes(content)
        for load in (load_metadata, lambda folder: load_chunk_table(folder)[0]):
            try:
                metadata = load(Path(d))
            except MergerError as e:
                assert ".metadata" in str(e)
                continue
            assert isinstance(metadata, Metadata)


def test_seed_loads(seed):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / ".metadata").write_bytes(seed)
        assert set(load_metadata(Path(d)).state_dict_metadata) == {"w", "b"}


@pytest.mark.parametrize("field", [b"chunks", b"storage_data"])
def test_a_field_a_damaged_pickle_leaves_out(seed, field):
    """What test_mutated_seed once drew: one byte of a field's name changed in the pickle's state, so the object
    lacks that field (load_metadata raised AttributeError on a tensor with no `chunks`)."""
    i = seed.index(field)
    check(seed[:i] + b"x" + seed[i + 1:])


@SETTINGS
@given(st.binary(max_size=512))
def test_arbitrary_bytes(content):
    check(content)


@SETTINGS
@given(st.data())
def test_mutated_seed(seed, data):
    content = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(content) - 1))
        content[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(content)))
    check(bytes(content[:cut]))
