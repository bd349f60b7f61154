"""`.metadata` read as arrays (sources/dcp_compact) against torch's own reading of it.

The oracle is torch: `FileSystemReader(folder).read_metadata()`. merger's load_metadata makes every chunk and
storage entry from the arrays dcp_compact read, so each must equal torch's object field by field, in torch's
order (index hints included), on checkpoints torch writes and on random metadata built from torch's classes and
pickled as its FileSystemWriter pickles it (hypothesis). Each test also checks that the arrays did the work
(the records were cut out of the pickle), so a silent fall back to the plain load cannot pass for it.
"""
from __future__ import annotations

import io
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from merger.errors import MergerError
from merger.sources.dcp_metadata import load_compact, load_metadata
from tests.helpers.dcp_fields import plain


def _keys(md) -> list:
    """storage_data's keys in order, with the index hint equality leaves out."""
    return [(k.fqn, None if k.offset is None else tuple(k.offset), k.index) for k in md.storage_data]


def assert_read_as_torch(folder: Path) -> tuple[int, int]:
    """Asserts load_metadata equals torch's read; returns (chunks, storage entries) read as arrays."""
    theirs = FileSystemReader(str(folder)).read_metadata()
    ours = load_metadata(folder)
    # read_metadata stamps its own load: the id of it in storage_meta (made for it when the file has none)
    if ours.storage_meta is None:
        theirs.storage_meta = None
    else:
        theirs.storage_meta.load_id = ours.storage_meta.load_id
    assert plain(ours) == plain(theirs)
    assert _keys(ours) == _keys(theirs)
    for fqn, md in theirs.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in ours.state_dict_metadata[fqn].chunks] == \
                [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    _, records = load_compact(folder)
    return len(records.chunk_nd), len(records.storage["fqn"])


@pytest.mark.parametrize("folder", ["plain", "checkpoint-1", "tp"])
def test_written_checkpoints_read_as_torch(dcp_written, folder):
    root = dcp_written(folder)
    chunks, entries = assert_read_as_torch(root / "pytorch_model_fsdp_0" if folder == "checkpoint-1" else root)
    assert chunks > 0 and entries > 0


def test_odd_tensors_read_as_torch(tmp_path):
    """A scalar, an empty tensor, 3-d, 4-d (left to the plain reader) and integer tensors, by dcp.save."""
    dcp.save({"a": torch.ones(3, 4), "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 5), "b": torch.ones(2),
              "cube": torch.arange(24.0).reshape(2, 3, 4), "four": torch.ones(1, 2, 1, 2), "steps": torch.arange(5),
              "step": 3}, checkpoint_id=tmp_path, no_dist=True)
    chunks, entries = assert_read_as_torch(tmp_path)
    assert chunks > 0 and entries > 0


def _metadata(tensors: list, paths_shared: bool, extras: bool) -> Metadata:
    """Metadata from torch's classes: tensors [(ndim, [(offsets, sizes, index or None)])], storage in tensor order;
    one path object per rank (pickled once, then looked up) or a fresh string per entry (pickled each time)."""
    state, storage = {}, {}
    shared = [f"__{r}_0.distcp" for r in range(4)]
    for t, (ndim, chunks) in enumerate(tensors):
        fqn = f"model.layers.{t}.w"
        boxes = [ChunkStorageMetadata(torch.Size(o[:ndim]), torch.Size(s[:ndim])) for o, s, _ in chunks]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([9] * ndim), boxes)
        for k, (offsets, sizes, index) in enumerate(chunks):
            path = shared[k % 4] if paths_shared else f"__{k % 4}_0.distcp"
            storage[MetadataIndex(fqn, offsets[:ndim], index)] = _StorageInfo(path, sizes[0] * 7 + k, offsets[0])
    planner_data = {fqn: tuple(fqn.split(".")) for fqn in state}
    if extras:  # objects shared by identity with records (memo lookups into them), a byte entry, a transform
        some = next(iter(state.values())).chunks[0]
        planner_data["shared"] = [some, some.offsets, some.sizes]
        key = next(iter(storage))
        planner_data["key"] = key
        object.__setattr__(key, "offset", some.offsets)  # the storage key pickles a lookup of the chunk's Size
        state["optim.step"] = BytesStorageMetadata()
        storage[MetadataIndex("optim.step")] = _StorageInfo("__0_0.distcp", 4096, 7)
        last = list(storage)[-2]
        storage[last] = _StorageInfo(storage[last].relative_path, 1, 2, ["zstd"])
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage, version="1.0.0")


def _write(folder: Path, md: Metadata, protocol: int) -> None:
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f, protocol=protocol)


ints = st.integers(-2**33, 2**40) | st.integers(0, 300)
box = st.tuples(st.lists(ints, min_size=4, max_size=4), st.lists(ints, min_size=4, max_size=4),
                st.none() | st.integers(0, 2**20))
tensor = st.tuples(st.integers(0, 4), st.lists(box, min_size=1, max_size=6))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=st.lists(tensor, min_size=1, max_size=8), paths_shared=st.booleans(), extras=st.booleans(),
       protocol=st.sampled_from([pickle.DEFAULT_PROTOCOL, 5, 2]))
def test_random_metadata_reads_as_torch(tensors, paths_shared, extras, protocol):
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d), _metadata(tensors, paths_shared, extras), protocol)
        chunks, entries = assert_read_as_torch(Path(d))
    # Protocol 4+: every chunk of up to 3 dims after the first (whose keys the pickle spells out) is an array row.
    if protocol >= 4 and not extras:
        small = sum(len(c) for nd, c in tensors if nd <= 3)
        assert chunks == max(small - 1, 0) or (small and tensors[0][0] > 3 and chunks == small)


def test_large_metadata_reads_as_torch_in_arrays(tmp_path):
    """1,600 chunks: storage_data spans SETITEMS batches (1,000 items each) and the pickle several 64 KiB frames,
    whose headers fall inside records (taken out, each checked to stand between two opcodes)."""
    boxes = [([r * 3, 0, 0, 0], [3, 5, 0, 0], r) for r in range(40)]
    md = _metadata([(2, boxes)] * 40, paths_shared=False, extras=False)
    _write(tmp_path, md, pickle.DEFAULT_PROTOCOL)
    assert (tmp_path / ".metadata").stat().st_size > 3 * 2**16
    chunks, entries = assert_read_as_torch(tmp_path)
    assert chunks == entries == 1600 - 1  # all but the first of each, whose keys the pickle spells out


def _with_persistent_ids(md: Metadata) -> bytes:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return 0 if isinstance(obj, ChunkStorageMetadata) else None
    out = io.BytesIO()
    Pickler(out, protocol=pickle.DEFAULT_PROTOCOL).dump(md)
    return out.getvalue()


def test_persistent_ids_in_the_file_are_refused(tmp_path):
    """dcp_compact puts persistent ids in place of the runs it cuts; one in the file itself is refused as before."""
    (tmp_path / ".metadata").write_bytes(_with_persistent_ids(_metadata([(2, [([0] * 4, [1] * 4, 0)] * 3)],
                                                                        True, False)))
    with pytest.raises(MergerError,
                       match=r"(?s)not a DCP metadata file \(A load persistent id instruction.*\.metadata"):
        load_metadata(tmp_path)


class _Payload:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_a_global_after_the_runs_is_refused(tmp_path, monkeypatch):
    """A payload after thousands of records cut out as arrays is refused as the plain load refuses it."""
    md = _metadata([(2, [([r, 0, 0, 0], [1, 2, 0, 0], r) for r in range(30)])] * 30, True, False)
    md.planner_data["x"] = _Payload()
    _write(tmp_path, md, pickle.DEFAULT_PROTOCOL)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MergerError, match=r"refusing to load global (posix|os)\.system\), .*\.metadata"):
        load_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()
