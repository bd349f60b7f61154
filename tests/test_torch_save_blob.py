"""Tensors read out of torch.save blobs (how merger reads DCP chunks), against torch.load itself.

Blobs are written by torch.save, several to one file at odd offsets as DCP's FileSystemWriter lays them out,
including views that keep a larger storage, transposes and empty tensors. A blob whose pickle would run code
is refused before anything runs; damaged bytes give BlobError, or a checksum mismatch when only the data is
damaged, never another exception and never a wrong tensor.
"""
from __future__ import annotations

import io
import pickle
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from merger.errors import MergerError
from merger.catalog import Stored
from merger.sources.file_reads import SourceReads
from merger.sources.torch_save_blob import BlobError, tensor_in_blob

pytestmark = pytest.mark.interpreter

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


def _written(path: Path, blobs: list[bytes]) -> list[tuple[int, int]]:
    """The blobs written back to back after a 3-byte lead-in (so none starts aligned), as DCP lays them out."""
    spans = []
    with open(path, "wb") as f:
        f.write(b"DCP")
        for blob in blobs:
            spans.append((f.tell(), len(blob)))
            f.write(blob)
    return spans


def _read(path: Path, offset: int, length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The blob's tensor as merger reads it: located from the blob's directory, copied with pread (casting)."""
    reads = SourceReads()
    try:
        view, record = tensor_in_blob(reads.files.range_file(str(path), offset, length), length)
        record = replace(record, start=offset + record.start)
        out = torch.empty(view.shape, dtype=dtype or view.dtype)
        reads.copy(Stored(str(path), record.start, view, record), out, "t")
        reads.finish()
    finally:
        reads.close()
    return out


@pytest.mark.parametrize("cast", [False, True])
def test_reads_equal_torch_load(tmp_path, cast):
    blobs = [_saved(t) for t in CASES.values()]
    path = tmp_path / "chunks.distcp"
    for (name, _), blob, (offset, length) in zip(CASES.items(), blobs, _written(path, blobs)):
        expected = torch.load(io.BytesIO(blob), weights_only=True)
        dtype = torch.float32 if cast and expected.is_floating_point() else None
        got = _read(path, offset, length, dtype)
        assert got.shape == expected.shape, name
        assert torch.equal(got, expected.to(dtype or expected.dtype)), name


@pytest.mark.parametrize("name", ["slice of a larger storage", "column block", "fp16 weight"])
def test_flipped_bit_in_storage_fails_its_checksum(tmp_path, name):
    """Any bit of the storage record, inside the tensor or in the padding around it, is covered by the zip's CRC-32."""
    blob = _saved(CASES[name])
    path = tmp_path / "chunks.distcp"
    (offset, length), = _written(path, [blob])
    view, record = tensor_in_blob(io.BytesIO(blob), length)
    for at in (0, record.size - 1, record.size // 2):
        data = bytearray(path.read_bytes())
        data[offset + record.start + at] ^= 0x10
        damaged = tmp_path / f"damaged_{at}.distcp"
        damaged.write_bytes(data)
        with pytest.raises(MergerError, match=f"checksum mismatch in tensor t: the CRC-32 of zip record "
                                              f"{record.name} .*, {damaged}"):
            _read(damaged, offset, length)


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
        tensor_in_blob(io.BytesIO(blob), len(blob))
    assert not marker.exists()


def test_storage_smaller_than_the_tensor_is_refused():
    """A pickle claiming more elements than its storage holds would read past the record: refused."""
    blob = _saved(torch.arange(4.0))
    archive = zipfile.ZipFile(io.BytesIO(blob))
    lying = archive.read("archive/data.pkl").replace(b"K\x04\x85", b"K\x09\x85")  # size (4,) -> (9,)
    assert lying != archive.read("archive/data.pkl")
    with pytest.raises(BlobError, match="reaches element"):
        lying_blob = _with_pickle(blob, lying)
        tensor_in_blob(io.BytesIO(lying_blob), len(lying_blob))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_blobs_raise_blob_error_only(data):
    blob = bytearray(_saved(torch.randn(4, 3)))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[:data.draw(st.integers(0, len(blob)))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chunk.distcp"
        path.write_bytes(blob)
        try:
            _read(path, 0, len(blob))
        except BlobError:
            return
        except MergerError as e:  # whatever was accepted lies inside the blob, and its damage is caught
            assert "checksum mismatch" in str(e), e
