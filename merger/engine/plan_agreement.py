"""Ranks that agree on what they merge, before any byte is written.

Every rank builds the catalog and the plan itself, from what its own filesystem shows. One node that mounts an
older copy of the checkpoint, or sees a file the others don't, would plan another merge: the ranks would meet at
the first exchange with mismatched sizes, or write a model mixed from two checkpoints. So after planning they
compare a digest of both: the source files (each one's path inside the checkpoint and its size) and the plan
(every output file's tensors: names, dtypes, shapes and data ranges, which fix its header; the writing rank of
each step and the batches). A mismatch stops every rank with the same line, naming the ranks and the first
difference.

Paths and sizes, not inodes or mtimes: copies of one checkpoint on each node's own disk are as good as one
shared folder, and their inodes and mtimes differ.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..catalog import Catalog
from ..errors import AgreedError
from ..io import file_size, location, relative_name
from ..io.locations import ObjectPath
from .dist import Group
from .plan import Plan


@dataclass(frozen=True)
class PlanDigest:
    source_files: int
    source_bytes: int
    files: str  # sha256 of every (path, size), in catalog order
    tensors: int  # source tensors
    plan: str  # sha256 of the output files' tensors, the writer of each step and the batches


# The fields in the order a difference is reported: the plainest first.
_COUNTS = {"source_files": "source files", "source_bytes": "bytes of source files", "tensors": "source tensors"}
_ORDER = ("source_files", "source_bytes", "files", "tensors", "plan")


def _relative(path: str, root: Path | ObjectPath) -> str:
    """A source file as every node names it: inside the checkpoint, its path there (nodes may mount it at
    different places); elsewhere (a base model) its path as given."""
    return relative_name(path, root) if root in location(path).parents else path


def source_files(catalog: Catalog) -> list[tuple[str, int]]:
    root = location(catalog.root)
    return [(_relative(f, root), file_size(f)) for f in catalog.files]


def _sha256(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
    return h.hexdigest()


def plan_digest(files: list[tuple[str, int]], catalog: Catalog, plan: Plan | None) -> PlanDigest:
    """The digest of what a rank merges; `plan` None: of the checkpoint alone, before planning."""
    layout = [(f.name, f.indexed, f.entries) for f in plan.files] if plan is not None else None
    batches = [(b.steps, len(b.routes), b.out_bytes) for b in plan.batches] if plan is not None else None
    return PlanDigest(len(files), sum(size for _, size in files), _sha256(files), len(catalog.tensors),
                      _sha256(layout, plan.writers if plan is not None else None, batches))


def _describe(rank: int, digests: list[PlanDigest], files: list[list[tuple[str, int]]]) -> str:
    """How `rank` differs from rank 0, by the first field in _ORDER that differs."""
    mine, ref = digests[rank], digests[0]
    field = next(f for f in _ORDER if getattr(mine, f) != getattr(ref, f))
    if field in _COUNTS:
        line = f"rank {rank} sees {getattr(mine, field)} {_COUNTS[field]}, rank 0 sees {getattr(ref, field)}"
        return line if field == "tensors" else f"{line}: {_first_file_difference(files[rank], files[0], rank)}"
    if field == "files":
        return f"rank {rank} and rank 0 see other source files: {_first_file_difference(files[rank], files[0], rank)}"
    return f"rank {rank} and rank 0 read the same files but planned other outputs (another config or options?)"


def _first_file_difference(theirs: list[tuple[str, int]], ours: list[tuple[str, int]], rank: int) -> str:
    their_sizes, our_sizes = dict(theirs), dict(ours)
    for name, size in sorted({*theirs, *ours}):
        if name not in our_sizes:
            return f"{name} only on rank {rank}"
        if name not in their_sizes:
            return f"{name} only on rank 0"
        if their_sizes[name] != our_sizes[name]:
            return f"{name} is {their_sizes[name]} bytes on rank {rank}, {our_sizes[name]} on rank 0"
    return "the same files in another order"


def agree_on_plan(catalog: Catalog, plan: Plan | None, group: Group, files: list[tuple[str, int]] | None = None
                  ) -> None:
    """Raise the same AgreedError on every rank unless every rank built the same catalog and plan (`plan` None:
    the same catalog, before anything is read from it); `files` are the source files as this rank sees them
    (default: source_files(catalog))."""
    if not group.distributed:
        return
    files = source_files(catalog) if files is None else files
    digests = group.all_gather(plan_digest(files, catalog, plan))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differ:
        return
    every_files = group.all_gather(files)  # only now: file lists may be long, and agreement is the common case
    more = len(differ) - 1
    others = f" (and {more} more rank{'s' * (more > 1)})" if more else ""
    raise AgreedError(f"the ranks see different checkpoints: {_describe(differ[0], digests, every_files)}{others}; "
                      f"every rank must see the same files (one shared folder, or identical copies), {catalog.root}")
