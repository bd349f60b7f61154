"""The storage records of a torch.save zip archive: where each one's bytes start, how many, and their CRC-32.

torch.save writes an uncompressed zip whose `<archive>/data/<key>` records hold the storages' raw bytes. The
central directory gives each record's local header, size and CRC-32; the local header (whose extra field
torch uses to align the data) gives where the bytes start.
"""
from __future__ import annotations

import struct
import zipfile
from typing import BinaryIO

from ..catalog import ZipRecord

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


class ZipRecordError(ValueError):
    """The archive's records cannot be located (the caller names the file)."""


def open_archive(fileobj: BinaryIO) -> tuple[zipfile.ZipFile, dict[str, zipfile.ZipInfo]]:
    """The archive and its entries by name without the archive folder (`data.pkl`, `data/0`, `byteorder`...).
    A big-endian save is refused: its bytes would need swapping, which reading them as they lie cannot do."""
    archive = zipfile.ZipFile(fileobj)  # reads the directory at the end, not the data
    entries = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    if entries.get("byteorder") is not None and archive.read(entries["byteorder"]) != b"little":
        raise ZipRecordError("saved big-endian")
    return archive, entries


def storage_record(fileobj: BinaryIO, info: zipfile.ZipInfo, base: int = 0) -> ZipRecord:
    """The record of one storage entry; `base` is added to its start (the archive's own offset in its file)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ZipRecordError(f"record {info.filename} is compressed")
    fileobj.seek(info.header_offset)
    header = fileobj.read(_LOCAL_HEADER.size)
    if info.header_offset < 0 or len(header) < _LOCAL_HEADER.size:
        raise ZipRecordError(f"record {info.filename} has no local zip header")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != _LOCAL_SIGNATURE:
        raise ZipRecordError(f"record {info.filename} has no local zip header")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return ZipRecord(info.filename.split("/", 1)[-1], base + start, info.file_size, info.CRC)
