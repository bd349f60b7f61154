"""merger's stand-ins for DCP's metadata classes (merger/sources/dcp_classes.py) against torch's own.

The `.metadata` files here are pickles of torch's real classes (as dcp.save writes them), with several
chunks per tensor, a non-tensor entry, storage entries keyed by MetadataIndex, a save plan as planner data
and storage_meta; and as an older torch wrote them, without the fields added since. The oracle is torch:
the same file read back with torch's classes (plain pickle.loads of a file written in this test).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import io
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata, planner

from merger.errors import MergerError
from merger.sources import dcp_classes
from merger.sources.dcp_chunk_table import load_chunk_table
from merger.sources.dcp_metadata import load_metadata
from tests.helpers.dcp_fields import plain
from tests.helpers.enums_by_name import EnumsByName
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.interpreter


def _chunks(*boxes):
    return [metadata.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]


def _torch_metadata() -> metadata.Metadata:
    """A Metadata built from torch's classes: what a 4-rank FSDP2/TP save of a few tensors records."""
    w_boxes = [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (2, 6)), ((8, 0), (0, 6))]  # the last rank empty
    e_boxes = [((0, 0, 0), (2, 4, 3)), ((0, 4, 0), (2, 4, 3)), ((2, 0, 0), (2, 4, 3)), ((2, 4, 0), (2, 4, 3))]
    tensors = {
        "model.w": (torch.bfloat16, torch.contiguous_format, (8, 6), w_boxes),
        "model.experts": (torch.float32, torch.channels_last, (4, 8, 3), e_boxes),
        "model.b": (torch.float16, torch.preserve_format, (5,), [((0,), (5,))]),
    }
    sd_meta, storage, items = {}, {}, []
    for rank, (fqn, (dtype, memory_format, size, boxes)) in enumerate(tensors.items()):
        props = metadata.TensorProperties(dtype=dtype, memory_format=memory_format)
        sd_meta[fqn] = metadata.TensorStorageMetadata(props, torch.Size(size), _chunks(*boxes))
        for k, (offsets, sizes) in enumerate(boxes):
            index = metadata.MetadataIndex(fqn, offsets, index=k)
            storage[index] = filesystem._StorageInfo(f"__{k}_{rank}.distcp", 1000 * rank + 17 * k, 64 + k)
            chunk = sd_meta[fqn].chunks[k]
            items.append(planner.WriteItem(index, planner.WriteItemType.SHARD,
                                           tensor_data=planner.TensorWriteData(chunk, props, torch.Size(size))))
    storage[metadata.MetadataIndex("model.w", (0, 0), index=0)].transform_descriptors = ["zstd"]
    sd_meta["optim.step"] = metadata.BytesStorageMetadata()
    storage[metadata.MetadataIndex("optim.step")] = filesystem._StorageInfo("__0_0.distcp", 4096, 7)
    items.append(planner.WriteItem(metadata.MetadataIndex("optim.step"), planner.WriteItemType.BYTE_IO))
    items.append(planner.WriteItem(metadata.MetadataIndex("model.b", (0,)), planner.WriteItemType.TENSOR))
    planner_data = {"model.w": ("model", "w"), "model.experts": ("model", "experts"), "model.b": ("model", "b"),
                    "optim.step": ("optim", "step"), "plan": planner.SavePlan(items, planner_data={"k": 1})}
    return metadata.Metadata(sd_meta, planner_data=planner_data, storage_data=storage, version="1.0.0",
                             storage_meta=metadata.StorageMeta(Path("/ckpt/step-10"), "save-1", None, ["model"]))


def _as_older_torch(md: metadata.Metadata) -> metadata.Metadata:
    """The same metadata as a torch without the fields added over time pickled it: those keys absent."""
    for obj, names in ((md, ("storage_meta", "version")), (md.planner_data["plan"], ("usable",))):
        for name in names:
            del obj.__dict__[name]
    return md


def _loaded(tmp_path: Path, content: bytes):
    (tmp_path / ".metadata").write_bytes(content)
    return load_metadata(tmp_path), pickle.loads(content)  # ours, and torch's classes reading the same bytes


def _by_name(md: metadata.Metadata) -> bytes:
    out = io.BytesIO()
    EnumsByName(out, protocol=pickle.DEFAULT_PROTOCOL).dump(md)
    assert b"getattr" in out.getvalue()
    return out.getvalue()


PICKLINGS = {
    "as dcp.save pickles": pickle.dumps,
    "protocol 2": functools.partial(pickle.dumps, protocol=2),
    "enums by name (Python 3.11.0-3.11.4)": _by_name,
}


@pytest.mark.parametrize("older", [False, True], ids=["current torch", "older torch"])
@pytest.mark.parametrize("how", list(PICKLINGS))
def test_loads_every_field_as_torch_reads_it(tmp_path, how, older):
    built = _as_older_torch(_torch_metadata()) if older else _torch_metadata()
    ours, theirs = _loaded(tmp_path, PICKLINGS[how](built))
    assert isinstance(ours, dcp_classes.Metadata)
    assert plain(ours) == plain(theirs)  # every field, class-level defaults of missing ones included

    # The fields merger's readers use, one by one.
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        if isinstance(md, metadata.BytesStorageMetadata):
            assert isinstance(mine, dcp_classes.BytesStorageMetadata)
            continue
        assert isinstance(mine, dcp_classes.TensorStorageMetadata)
        assert mine.size == md.size and mine.properties.dtype is md.properties.dtype
        assert mine.properties.memory_format is md.properties.memory_format
        assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in md.chunks]
    assert len(ours.storage_data) == len(theirs.storage_data) == 10
    for index, info in theirs.storage_data.items():
        # A lookup by (fqn, offset) alone: the index hint is no part of the key.
        mine = ours.storage_data[dcp_classes.MetadataIndex(index.fqn, index.offset, index=99)]
        assert (mine.relative_path, mine.offset, mine.length) == (info.relative_path, info.offset, info.length)
        assert mine.transform_descriptors == info.transform_descriptors
    assert ours.storage_data[dcp_classes.MetadataIndex("model.w", torch.Size((0, 0)))].transform_descriptors \
        == ["zstd"]
    assert ours.storage_data[dcp_classes.MetadataIndex("model.b", torch.Size((0,)))].transform_descriptors is None
    assert ours.planner_data["model.w"] == ("model", "w")
    assert ours.planner_data["plan"].items[0].type is dcp_classes.WriteItemType.SHARD
    assert ours.planner_data["plan"].usable is theirs.planner_data["plan"].usable is True
    if older:
        assert ours.storage_meta is theirs.storage_meta is None and ours.version is theirs.version is None
    else:
        assert ours.storage_meta.modules == theirs.storage_meta.modules == ["model"]
        assert ours.version == theirs.version == "1.0.0"


def test_stand_ins_have_torch_fields_and_members():
    """Each stand-in declares the fields (with what equality and hashing use) or the members of torch's class."""
    for (module, name), stand_in in dcp_classes.TORCH_NAMES.items():
        theirs = getattr(importlib.import_module(module), name)
        assert stand_in.__name__ == name
        if issubclass(theirs, enum.Enum):
            assert {m.name: m.value for m in stand_in} == {m.name: m.value for m in theirs}
            continue
        fields = [(f.name, f.compare, f.hash) for f in dataclasses.fields(stand_in)]
        assert fields == [(f.name, f.compare, f.hash) for f in dataclasses.fields(theirs)], name


def test_opening_a_dcp_checkpoint_imports_no_torch_distributed_checkpoint(tmp_path):
    """The point of the stand-ins: that package brings DTensor and sympy, half a second of every DCP merge."""
    dcp.save({"w": torch.ones(4, 2), "b": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)
    code = ("import sys; from pathlib import Path; from merger.sources.dcp import open_catalog; "
            "assert sorted(open_catalog(Path(sys.argv[1])).tensors) == ['b', 'w']; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.checkpoint', "
            "'torch.distributed.tensor'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def _global(module: str, name: str) -> bytes:
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.planner", "ReadItem"),  # a DCP class no `.metadata` holds
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint.metadata", "Any"),  # a name merely in the module
    ("merger.sources.dcp_classes", "Metadata"),  # the stand-ins under their own name
    ("os", "system"),
])
@pytest.mark.parametrize("load", [load_metadata, load_chunk_table])
def test_global_outside_the_list_is_refused(tmp_path, module, name, load):
    (tmp_path / ".metadata").write_bytes(_global(module, name))
    with pytest.raises(MergerError, match=re.escape(f"(refusing to load global {module}.{name}), {tmp_path}")):
        load(tmp_path)
