"""`merger inspect --check`: read what a merge would read and the format checksums, merging nothing.

A merge checks torch.save's CRC-32s while it reads, so a damaged rank file can be found hours into a large
merge (a plan checks only that each file is as long as its own directory or metadata say: a file cut at its
end). This check finds it first: every file's size is checked as a plan does, every file is opened and checked
against the catalog by the merge's own reader, every record holding a merged tensor is read whole and its CRC-32
compared (SourceReads.verify, the merge's check), and every safetensors tensor must lie within its file. Each
file is checked separately, so one line names each bad file. Under torchrun each rank checks the files it would
open in a merge (Catalog.files_of_rank) and every rank learns every result.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import Failure, failure_of
from ..sources.file_reads import SourceReads
from .dist import Group, on_every_rank


@dataclass(frozen=True)
class SourceCheck:
    files: int  # files checked, on all ranks
    bytes: int  # bytes read and checksummed, or bounded within their file
    bad: dict[str, Failure]  # file -> its error line and kind, in the catalog's file order


def check_sources(catalog: Catalog, group: Group, debug: bool = False) -> SourceCheck:
    mine = catalog.files_of_rank(group.rank, group.world)
    opened = set(mine)
    pieces_in: dict[str, list[tuple[SourceTensor, ShardPiece, PieceCopy]]] = {}
    for t in catalog.tensors.values():
        for piece in t.pieces:
            for copy in piece.copies:  # every copy: a replica's file is checked like any other
                if copy.file in opened:  # this rank's files only: the others are its peers' to check
                    pieces_in.setdefault(copy.file, []).append((t, piece, copy))
    bad = _cut_short(catalog, mine, group.rank, debug)
    reader = on_every_rank(group, catalog.open_reader, debug)
    bad.update(_opened(reader, [f for f in mine if f not in bad], group.rank, debug))
    reads = SourceReads()
    checked = 0
    try:
        for file in mine:
            if file in bad:
                continue
            try:
                for t, piece, copy in pieces_in.get(file, ()):
                    checked += reads.verify(reader.locate(copy, piece, t.dtype), t.name)
            except Exception as e:  # noqa: BLE001 - the file's first problem is its line; the others are checked
                bad[file] = failure_of(e, group.rank, debug)
    finally:
        reads.close()
    shares = group.all_gather((len(mine), checked, bad))
    failures = {file: failure for s in shares for file, failure in s[2].items()}
    return SourceCheck(sum(s[0] for s in shares), sum(s[1] for s in shares),
                       {file: failures[file] for file in catalog.files if file in failures})  # in the catalog's order


def _cut_short(catalog: Catalog, files: list[str], rank: int, debug: bool) -> dict[str, Failure]:
    """The plan's size check (Catalog.check_file), file by file: file -> the failure of those it refuses."""
    bad = {}
    for file in files if catalog.check_file else ():
        try:
            catalog.check_file(file)
        except Exception as e:  # noqa: BLE001 - each bad file gets its line
            bad[file] = failure_of(e, rank, debug)
    return bad


def _opened(reader, files: list[str], rank: int, debug: bool) -> dict[str, Failure]:
    """The reader's own check of `files` (opened, shapes and placements as the catalog says): file -> the failure
    of those that fail. All at once first, as a merge does (readers go through the catalog on each call); one
    by one only when that fails, to name every bad file, not just the first."""
    try:
        reader.check_files(files)
        return {}
    except Exception:  # noqa: BLE001 - told apart file by file below
        pass
    bad = {}
    for file in files:
        try:
            reader.check_files([file])
        except Exception as e:  # noqa: BLE001
            bad[file] = failure_of(e, rank, debug)
    return bad
