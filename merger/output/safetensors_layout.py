"""Each output file as safetensors lays it out: the header (its length, then JSON naming every tensor's dtype, shape
and data range), then the data section the plan placed the tensors in (engine/plan.py).

The header is the output format's business, not the plan's: the plan stays a value of names, shapes and ranges,
and this module turns each of its files into bytes on disk. The headers of 100k tensors take most of a second to
build, and the sink, the checksum tracker, the manifest, the file creation and the summary all ask for them, so each
file's is built once and kept as long as the plan's file is.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from ..engine.plan import OutputFile
from ..safetensors_io import header_bytes


@dataclass(frozen=True)
class FileLayout:
    header: bytes  # the file's first bytes: the header's length, then its JSON; the data section follows
    size: int  # the whole file's bytes: the header's and the data section's

    @property
    def data_start(self) -> int:
        """Where the data section starts in the file: a tensor's bytes lie at data_start + its entry's begin."""
        return len(self.header)


# By the identity of the plan's OutputFile, not its value: hashing or comparing 100k entries would cost as much as
# a lookup saves. A plan that skip_finished or rerouted derives keeps the same files, and so their layouts.
_LAYOUTS: dict[int, FileLayout] = {}


def file_layout(f: OutputFile) -> FileLayout:
    """`f` as safetensors lays it out, built the first time any part of the merge asks (two threads asking at once
    build it twice, harmlessly)."""
    layout = _LAYOUTS.get(id(f))
    if layout is None:
        header = header_bytes(f.entries)
        layout = _LAYOUTS[id(f)] = FileLayout(header, len(header) + f.data_bytes)
        weakref.finalize(f, _LAYOUTS.pop, id(f), None)  # gone with the file, before its id can name another
    return layout


def file_sizes(files: Iterable[OutputFile]) -> dict[str, int]:
    """Each file's name -> its whole size: what a bucket target's stage makes room for and sends in parts."""
    return {f.name: file_layout(f).size for f in files}
