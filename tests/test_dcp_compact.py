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
import pickletools
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
                                                   MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from merger.errors import CorruptSourceError, MergerError
from merger.sources.dcp_compact import NOT_READ
from merger.sources.dcp_metadata import load_compact, load_metadata
from tests.helpers.dcp_fields import plain

pytestmark = pytest.mark.slow


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


# megatron-core's torch_dist `.metadata` ends in `all_local_plans`: the SavePlan each rank made (a WriteItem per
# chunk it saved, holding the metadata's own chunk object), kept there to check a cached plan on the next save.
# dcp_compact skips it unread; everything else must still read as torch reads it.

def _plans_unread(folder: Path) -> bool:
    metadata, _ = load_compact(folder)
    return vars(metadata).get("all_local_plans") is NOT_READ


@pytest.mark.parametrize("case", ["moe_tp2_ep2", "tp2_pp2_vpp2_tied"])
def test_megatron_torch_dist_reads_as_torch_its_plans_unread(megatron_root, case):
    folder = megatron_root / case / "dist" / "iter_0000001"
    assert any(plan.items for plan in FileSystemReader(str(folder)).read_metadata().all_local_plans)
    chunks, _ = assert_read_as_torch(folder)
    assert chunks > 0 and _plans_unread(folder)


def _plans(md: Metadata, ranks: int = 4) -> list:
    """SavePlans as megatron-core gathers them: a WriteItem per chunk (round robin over ranks), its own key,
    the metadata's chunk object."""
    items = [[] for _ in range(ranks)]
    k = 0
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            for i, chunk in enumerate(meta.chunks):
                data = TensorWriteData(chunk, meta.properties, meta.size)
                items[k % ranks].append(WriteItem(MetadataIndex(fqn, torch.Size(chunk.offsets), i),
                                                  WriteItemType.SHARD, tensor_data=data))
                k += 1
    return [SavePlan(plan, storage_data=None, planner_data={}, usable=True) for plan in items]


def test_plans_over_many_frames_read_as_torch_unread(tmp_path):
    """1,600 WriteItems: the plans span many 64 KiB frames, whose headers must each stand between two opcodes."""
    md = _metadata([(2, [([r * 3, 0, 0, 0], [3, 5, 0, 0], r) for r in range(40)])] * 40, False, False)
    md.all_local_plans = _plans(md)
    _write(tmp_path, md, pickle.DEFAULT_PROTOCOL)
    assert (tmp_path / ".metadata").stat().st_size > 6 * 2**16
    assert assert_read_as_torch(tmp_path) == (1600 - 1, 1600 - 1)
    assert _plans_unread(tmp_path)


def test_a_payload_in_the_plans_is_never_run(tmp_path, monkeypatch):
    """The skipped plans are never unpickled: a global they name is not resolved, its call never made, and
    nothing of them reaches the catalog."""
    md = _metadata([(2, [([r, 0, 0, 0], [1, 2, 0, 0], r) for r in range(30)])] * 3, True, False)
    md.all_local_plans = _plans(md)
    (tmp_path / "clean").mkdir()
    _write(tmp_path / "clean", md, pickle.DEFAULT_PROTOCOL)
    md.all_local_plans[0].planner_data["x"] = _Payload()
    _write(tmp_path, md, pickle.DEFAULT_PROTOCOL)
    assert b"system" in (tmp_path / ".metadata").read_bytes()
    monkeypatch.chdir(tmp_path)
    assert plain(load_metadata(tmp_path)) == plain(load_metadata(tmp_path / "clean"))
    assert _plans_unread(tmp_path) and not (tmp_path / "pwned").exists()


def _memo_index_of(data: bytes, class_name: str) -> int:
    """The memo index of the first object NEWOBJ makes of `class_name` in a protocol 4 pickle."""
    memo, last_str, wanted = 0, None, False
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            if wanted == "made":
                return memo
            memo += 1
        elif op.name == "SHORT_BINUNICODE":
            last_str = arg
        elif op.name == "STACK_GLOBAL":
            wanted = wanted or last_str == class_name
        elif op.name == "NEWOBJ" and wanted is True:
            wanted = "made"
    raise AssertionError(class_name)


def test_plans_that_change_an_earlier_object_are_read(tmp_path):
    """A list in all_local_plans' place that BUILDs an object made before it (storage_meta, looked up in the
    memo) does not touch only itself: it is not skipped, and the load reads as torch's."""
    md = _metadata([(2, [([r, 0, 0, 0], [1, 2, 0, 0], r) for r in range(30)])] * 3, True, False)
    md.storage_meta = StorageMeta(checkpoint_id="ckpt", save_id="saved")
    md.all_local_plans = []
    data = pickle.dumps(md, protocol=4)
    assert data.endswith(b"]\x94ub.") and data[2] == 0x95 and len(data) < 2**16  # one frame
    changed = (b"j" + _memo_index_of(data, "StorageMeta").to_bytes(4, "little")
               + b"}\x94(\x8c\x07save_id\x8c\x07changedub")
    data = data[:-len(b"ub.")] + changed + b"aub."  # the list holds storage_meta, changed
    data = data[:3] + (len(data) - 11).to_bytes(8, "little") + data[11:]
    (tmp_path / ".metadata").write_bytes(data)
    assert FileSystemReader(str(tmp_path)).read_metadata().storage_meta.save_id == "changed"
    assert_read_as_torch(tmp_path)
    assert not _plans_unread(tmp_path)


def test_a_frame_header_inside_an_opcode_of_the_plans_is_refused(tmp_path):
    """Frames split only between opcodes; one header inside an opcode's argument, in the plans, makes the pickle
    one torch cannot load either: refused, not skipped over."""
    md = _metadata([(2, [([r, 0, 0, 0], [1, 2, 0, 0], r) for r in range(30)])] * 3, True, False)
    md.all_local_plans = _plans(md)
    data = pickle.dumps(md, protocol=4)
    assert data[2] == 0x95 and len(data) < 2**16  # one frame: PROTO, FRAME, the body from byte 11
    plans = data.index(b"all_local_plans")
    at = next(pos for op, _, pos in pickletools.genops(data) if pos > plans and op.name == "LONG_BINGET") + 2
    body = data[11:]
    at -= 11
    data = data[:2] + b"\x95" + at.to_bytes(8, "little") + body[:at] + b"\x95" \
        + (len(body) - at).to_bytes(8, "little") + body[at:]
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(pickle.UnpicklingError):
        FileSystemReader(str(tmp_path)).read_metadata()
    with pytest.raises(CorruptSourceError):
        load_metadata(tmp_path)
