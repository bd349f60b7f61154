"""The DCP catalog built from arrays (sources/dcp_chunk_table) against torch's own reading of `.metadata`.

The oracle is torch itself: `pickle.load` with torch.distributed.checkpoint's real classes (what its
FileSystemReader does), then each chunk looked up in `storage_data` by its MetadataIndex. Every piece of the
catalog must be exactly that chunk, in that file and byte range, on checkpoints torch and FSDP2/HSDP/TP write,
and on random ones pickled from torch's classes (hypothesis).
"""
from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from merger.errors import MergerError
from merger.sources.dcp import dcp_dir, open_catalog


def torch_pieces(folder: Path, prefix: str) -> dict[str, list]:
    """name -> [(offsets, sizes, file, (offset, length))] of every non-empty chunk, as torch's classes read them."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    out = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not fqn.startswith(prefix) or fqn.startswith("optim"):
            continue
        pieces = []
        for chunk in meta.chunks:
            if 0 in chunk.sizes and 0 not in meta.size:
                continue
            info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            pieces.append((tuple(chunk.offsets), tuple(chunk.sizes), str(folder / info.relative_path),
                           (info.offset, info.length)))
        out[fqn[len(prefix):]] = pieces
    return out


def assert_catalog_is_torchs(root: Path) -> None:
    catalog = open_catalog(root)
    folder = dcp_dir(root)
    prefix = "" if catalog.details["stripped_prefix"] == "none" else catalog.details["stripped_prefix"]
    expected = torch_pieces(folder, prefix)
    got = {name: [(p.offsets, p.sizes, c.file, c.byte_range) for p in t.pieces for c in p.copies]
           for name, t in catalog.tensors.items()}
    assert got == expected
    assert all(c.key == prefix + name for name, t in catalog.tensors.items() for p in t.pieces for c in p.copies)
    assert sorted(catalog.files) == sorted({f for pieces in expected.values() for _, _, f, _ in pieces})
    assert all(tuple(t.pieces) == t.pieces and len(t.pieces) == len(tuple(t.pieces)) for t in catalog.tensors.values())
    for t in catalog.tensors.values():  # the arrays the planner routes on (engine/plan.py) say what the pieces say
        sizes, file, files = t.pieces.one_copy_columns()
        assert [(tuple(s), [files[f]]) for s, f in zip(sizes.tolist(), file.tolist())] == \
            [(p.sizes, [c.file for c in p.copies]) for p in t.pieces]


@pytest.mark.parametrize("folder", ["plain", "checkpoint-1", "tp"])
def test_catalog_of_written_checkpoints_is_torchs(dcp_written, folder):
    assert_catalog_is_torchs(dcp_written(folder))


def test_catalog_of_odd_tensors_is_torchs(tmp_path):
    """A scalar, an empty tensor, 3-d and integer tensors, saved by dcp.save in one process."""
    dcp.save({"lm_head.weight": torch.ones(3, 4), "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 5),
              "cube": torch.arange(24.0).reshape(2, 3, 4), "steps": torch.arange(5)}, checkpoint_id=tmp_path)
    assert_catalog_is_torchs(tmp_path)


def _save(folder: Path, shapes: list[tuple[int, ...]], ranks: int, order: list[int]) -> None:
    """A `.metadata` pickled from torch's classes, as FSDP2 on `ranks` ranks saves: Shard(0) blocks, the storage
    entries in `order` of the ranks; sparse data files."""
    state, storage, ends = {}, {}, [0] * ranks
    entries = []
    for t, shape in enumerate(shapes):
        fqn, rows, chunks = f"lm_head.w{t}" if t == 0 else f"w{t}", -(-shape[0] // ranks) if shape else 1, []
        for r in range(ranks if shape else 1):
            start = min(r * rows, shape[0]) if shape else 0
            sizes = torch.Size([min(rows, shape[0] - start), *shape[1:]]) if shape else torch.Size([])
            offsets = torch.Size([start] + [0] * (len(shape) - 1)) if shape else torch.Size([])
            chunks.append(ChunkStorageMetadata(offsets, sizes))
            entries.append((r, MetadataIndex(fqn, offsets, r), 4 * sizes.numel() + 7))
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    for r in order:
        for rank, index, length in entries:
            if rank == r:
                storage[index] = _StorageInfo(f"__{r}_0.distcp", ends[r], length)
                ends[r] += length
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)
    for r in range(ranks):
        with open(folder / f"__{r}_0.distcp", "wb") as f:
            f.truncate(ends[r] + 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.lists(st.integers(0, 9), max_size=3).map(tuple), min_size=1, max_size=6),
       ranks=st.integers(1, 5), data=st.data())
def test_random_catalogs_are_torchs(shapes, ranks, data):
    order = data.draw(st.permutations(range(ranks)))
    with tempfile.TemporaryDirectory() as d:
        _save(Path(d), shapes, ranks, order)
        assert_catalog_is_torchs(Path(d))


def test_a_chunk_without_storage_entry_is_named(tmp_path):
    _save(tmp_path, [(4, 2), (6,)], 2, [0, 1])
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    del metadata.storage_data[MetadataIndex("w1", torch.Size([3]))]
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(MergerError, match=r"tensor w1 chunk at \(3,\) has no storage entry, .*\.metadata$"):
        open_catalog(tmp_path)


def test_a_chunk_saved_with_storage_transforms_is_refused(tmp_path):
    _save(tmp_path, [(4, 2), (6,)], 2, [1, 0])
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index = MetadataIndex("w1", torch.Size([3]))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset, info.length, ["zstd"])
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(MergerError, match=r"tensor w1 was saved with storage transforms \['zstd'\] .*\.metadata$"):
        open_catalog(tmp_path)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), bits=st.sampled_from([3, 40]))
def test_chunks_find_their_storage_entries_as_a_dict_would(data, bits):
    """Chunks are joined to storage entries by equal (tensor, ndim, offsets) rows, later entries winning, as torch's
    dict of MetadataIndex does: packed into one int where the columns fit 63 bits (3-bit values), compared as rows
    where they do not (40-bit values in 4 columns)."""
    from merger.sources.dcp_chunk_table import _storage_of
    value = st.integers(0, 2**bits - 1)
    rows = st.lists(st.tuples(value, value, value, value), min_size=1, max_size=30)
    keys, chunks = data.draw(rows), data.draw(rows)
    chunks += data.draw(st.lists(st.sampled_from(keys), max_size=10))  # some that have an entry
    infos = np.asarray(data.draw(st.permutations(range(len(keys)))), dtype=np.int64)
    expected = dict(zip(keys, infos.tolist()))

    def columns(table):
        return [np.asarray(c, dtype=np.int64) for c in zip(*table)]
    got = _storage_of(columns(chunks), columns(keys), infos)
    assert got.tolist() == [expected.get(c, -1) for c in chunks]
