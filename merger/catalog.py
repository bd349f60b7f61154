"""What a checkpoint holds, described from metadata alone: every source tensor and where its pieces live.

A source module (merger/sources/<format>.py) turns a checkpoint folder into a `Catalog` without reading
tensor data. The plan and the stream only ever see these values, so every format, every transform and
every launch mode share one engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    # torch's types appear here in annotations only. Not importing it keeps merger.sources' registry of formats,
    # which the command line's parser reads for --backend, free of torch.
    import torch


@dataclass(frozen=True, slots=True)
class PieceCopy:
    """One place where a piece's bytes are stored: a file plus how its format finds them there.

    `key` is the format's own locator (a state-dict key, a DCP storage index, a safetensors name);
    `byte_range` is set when the format knows the exact (offset, length) of the bytes in `file`.
    """

    file: str
    key: str
    byte_range: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """A box of the global tensor (`offsets`, `sizes` per dim) and every file that holds a copy of it.

    Replicated data (HSDP replicas, buffers saved by every rank) is one piece with several copies, so it
    is read once and never concatenated.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    copies: tuple[PieceCopy, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def row_major_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The element at `offsets` of a row-major tensor of `shape`, counted from its first element."""
    index, stride = 0, 1
    for o, n in zip(reversed(offsets), reversed(shape)):
        index += o * stride
        stride *= n
    return index


@dataclass(frozen=True)
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[ShardPiece, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def file(self) -> str:
        """The file holding its first piece: the one an error about the tensor names."""
        return self.pieces[0].copies[0].file


@dataclass(frozen=True)
class ZipRecord:
    """One storage record. `used` is the byte span [begin, end) of the record that some tensor views; bytes
    outside it are padding that no piece reads (a checksum still covers them)."""

    name: str  # data/<key>
    start: int  # where the data begins in the file
    size: int
    crc: int
    used: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Stored:
    """Where a piece's elements lie: `view` gives their geometry (dtype, shape, strides, storage offset; its data
    is never touched) in a storage whose bytes start at byte `start` of `file`. `record` is that storage's zip
    record when the format checksums it (its start is `start`). `start` None: `view` holds the data itself (a
    pre-zip torch file, loaded whole)."""

    file: str
    start: int | None
    view: torch.Tensor
    record: ZipRecord | None = None

    def narrowed(self, view: torch.Tensor) -> Stored:
        return Stored(self.file, self.start, view, self.record)


class PieceReader(Protocol):
    """Reads pieces from the files one merge rank opened. Formats implement it; the stream calls it."""

    def check_files(self, files: list[str]) -> None:
        """Open `files` and check them against the catalog (shapes, placements); raise MergerError."""

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        """Where the piece's data lies in `copy.file` (`Stored`), from metadata alone; the stream
        checks it has shape `piece.sizes` and dtype `dtype` and reads it."""


@dataclass
class Catalog:
    """A checkpoint as the planner sees it. `files` is ordered: merge rank i of M opens files i, i+M, ..."""

    format: str
    root: Path
    tensors: dict[str, SourceTensor]
    files: list[str]
    reader_factory: Callable[[Catalog], PieceReader]  # a reader class, or a partial of one
    hf_dir: Path | None = None
    # The names' convention, which picks the mapping: "hf" (HF module names, or torchtitan's, told apart by the
    # names themselves) or "megatron" (mcore names, mapped through the model family's table).
    naming: str = "hf"
    # Facts for `inspect` and the summary (world size, mesh, placements...), human-readable values.
    details: dict[str, object] = field(default_factory=dict)
    # Stored entries that are not merged, each with the rule that leaves it out (name -> rule): `inspect` lists them.
    skipped: dict[str, str] = field(default_factory=dict)
    # What reading the checkpoint found that its user should know (an unfinished save...): logged once by rank 0,
    # listed by `inspect`, with the mapping's notes.
    notes: tuple[str, ...] = ()
    # Raises MergerError when a file holds fewer bytes than its own directory or the checkpoint's metadata place in
    # it (a torch.save zip without the directory at its end, a .distcp shorter than .metadata says), reading no
    # tensor's bytes: every plan runs it on each file (`inspect` too, which opens no reader). None: the format
    # checks sizes while it builds the catalog (safetensors headers).
    check_file: Callable[[str], None] | None = None

    def open_reader(self) -> PieceReader:
        return self.reader_factory(self)

    def files_of_rank(self, rank: int, world: int) -> list[str]:
        return self.files[rank::world]

    def file_owner(self, world: int) -> dict[str, int]:
        """Which merge rank opens each file."""
        return {f: i % world for i, f in enumerate(self.files)}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
