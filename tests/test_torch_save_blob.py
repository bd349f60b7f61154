"""Tensors viewed in place inside torch.save blobs (how merger reads DCP chunks), against torch.load itself.

Blobs are written by torch.save, several to one file at odd offsets as DCP's FileSystemWriter lays them out,
including views that keep a larger storage, transposes and empty tensors. A blob whose pickle would run code
is refused before anything runs, and damaged bytes give BlobError, never another exception.
"""
from __future__ import annotations

import io
import mmap
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from merger.sources.torch_save_blob import BlobError, tensor_in_blob

CASES = {
    "slice of a larger storage": torch.arange(10.0, dtype=torch.bfloat16)[2:8],
    "transposed": torch.randn(5, 7).t(),
    "column block": torch.randn(3, 4)[:, 1:3],
    "scalar": torch.tensor(3.5, dtype=torch.float64),
    "empty": torch.empty(0, 4),
    "int64 buffer": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "fp16 weight": torch.randn(64, 48, dtype=torch.float16),
}


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _mapped(tmp_path: Path, blobs: list[bytes]) -> tuple[mmap.mmap, list[tuple[int, int]]]:
    """The blobs written back to back after a 3-byte lead-in (so none starts aligned), mapped privately."""
    path, spans = tmp_path / "chunks.distcp", []
    with open(path, "wb") as f:
        f.write(b"DCP")
        for blob in blobs:
            spans.append((f.tell(), len(blob)))
            f.write(blob)
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), spans


def test_views_equal_torch_load(tmp_path):
    blobs = [_saved(t) for t in CASES.values()]
    mapped, spans = _mapped(tmp_path, blobs)
    base = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
    for (name, _), blob, (offset, length) in zip(CASES.items(), blobs, spans):
        view = tensor_in_blob(memoryview(mapped)[offset:offset + length])
        expected = torch.load(io.BytesIO(blob), weights_only=True)
        assert view.dtype == expected.dtype and view.shape == expected.shape, name
        assert torch.equal(view, expected), name
        if view.numel():  # viewed in place: the bytes are those of the mapped file, not a copy
            assert base + offset <= view.data_ptr() < base + offset + length, name


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.mkdir, (self.marker,)


def _with_pickle(blob: bytes, payload: bytes) -> bytes:
    """`blob` with its data.pkl record replaced by `payload`, as a hostile checkpoint would ship it."""
    src, out = zipfile.ZipFile(io.BytesIO(blob)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, payload if info.filename.endswith("data.pkl") else src.read(info))
    return out.getvalue()


def test_code_running_pickle_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    blob = _with_pickle(_saved(torch.ones(3)), pickle.dumps(_RunsCode(marker), protocol=2))
    with pytest.raises(BlobError, match="refusing to load global"):
        tensor_in_blob(memoryview(bytearray(blob)))
    assert not marker.exists()


def test_storage_smaller_than_the_tensor_is_refused():
    """A pickle claiming more elements than its storage holds would read past the record: refused."""
    blob = _saved(torch.arange(4.0))
    archive = zipfile.ZipFile(io.BytesIO(blob))
    lying = archive.read("archive/data.pkl").replace(b"K\x04\x85", b"K\x09\x85")  # size (4,) -> (9,)
    assert lying != archive.read("archive/data.pkl")
    with pytest.raises(BlobError, match="reaches element"):
        tensor_in_blob(memoryview(bytearray(_with_pickle(blob, lying))))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_blobs_raise_blob_error_only(data):
    blob = bytearray(_saved(torch.randn(4, 3)))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        view = tensor_in_blob(memoryview(blob[:cut] if data.draw(st.booleans()) else blob))
    except BlobError:
        return
    view.clone()  # whatever was accepted lies inside the blob: reading all of it must not fault
