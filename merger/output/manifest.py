"""`merge_manifest.json`: what a staging folder or a finished merge holds (resume.py says what each field is
for). One dataclass, read by `read_manifest` and written by `write_manifest`; the file is plain JSON, its keys
the fields' names, in their order.

Reading is lenient on purpose: a manifest on disk may come from another merger version, or have been edited
by hand. A field the file lacks is None (an output file's entry likewise), and a field keeps whatever JSON
value the file holds: each reader checks what it relies on (`complete is True`, a list of names, ...) and
treats anything else as "not this merge". Only a file that is no JSON object is unreadable.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..errors import TargetError

MANIFEST = "merge_manifest.json"


@dataclasses.dataclass
class OutputEntry:
    """One output file: its size, the CRC-32 of its header, and the CRC-32 of each checksum block (None until
    the block is checked), each as 8 hex digits."""
    size: int | None = None
    header_crc32: str | None = None
    crc32_blocks: list[str | None] | None = None


@dataclasses.dataclass
class Manifest:
    merger_version: str | None = None
    source_format: str | None = None
    source_dir: str | None = None
    source_files: dict[str, dict[str, int]] | None = None  # path -> identity (source_identity.py)
    options: dict | None = None  # the options that shape the output, as JSON
    dtype: str | None = None
    merge_ranks: int | None = None
    checksum_algorithm: str | None = None  # "crc32"; absent in an older merger's manifest (sha256 checksums)
    checksum_block_bytes: int | None = None
    output_files: dict[str, OutputEntry] | None = None  # None: missing, or not a mapping of file entries
    complete: bool = False  # a finished merge: exactly True (a file read may hold any value here)
    copied_files: list[str] | None = None  # set when the merge finishes: the HF files copied beside the weights
    added_files: list[str] | None = None  # set when the output joins a config folder: what it added there

    def to_json(self) -> dict:
        """The file's contents: every field in order, the two set at the end only once they are."""
        out = dataclasses.asdict(self)
        for key in ("copied_files", "added_files"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """The manifest a JSON value describes, leniently (see the module's docstring); ValueError when it is
        not a JSON object."""
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        files = data.get("output_files")
        if isinstance(files, dict) and all(isinstance(entry, dict) for entry in files.values()):
            fields["output_files"] = {name: OutputEntry(**{f.name: entry.get(f.name)
                                                           for f in dataclasses.fields(OutputEntry)})
                                      for name, entry in files.items()}
        else:
            fields["output_files"] = None
        return cls(**fields)


def read_manifest(folder: Path) -> Manifest:
    """The manifest in `folder`: OSError when it is missing or unreadable (FileNotFoundError when there is
    none), ValueError when it is no JSON object."""
    return Manifest.from_json(json.loads((folder / MANIFEST).read_text()))


def write_manifest(stage: Path, manifest: Manifest) -> None:
    """Replace the manifest atomically: a crash leaves the old one or the new one, never half of one."""
    tmp = stage / (MANIFEST + ".tmp")
    try:
        tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        os.replace(tmp, stage / MANIFEST)
    except OSError as e:
        raise TargetError(f"cannot write the merge manifest ({e.strerror}), {tmp}") from e
