"""Streaming comparison of a merge with a HF folder: `merger test` against a reference, `merge --verify` against
the freshly written output. One code path for both.

The plan is run again with a `CompareSink` instead of the file writer, routed as the merge was: each rank
compares what it would write (a whole tensor, or the part of one it places directly) with the folder's bytes
at the same place, read with pread a chunk at a time, so the check holds no more than the merge's batches
(--max_inflight) and a chunk of the folder. A part the merge copies unchanged inside the kernel is compared
straight from the source file, chunk by chunk, and never enters a batch buffer. The folder itself is checked
first: every safetensors header valid, the index's entries in the files it names, total_size right. Rank 0
gathers the findings and prints the worst.

A tied lm_head the merge left out (`Plan.tie`) is compared too, with the folder's input embedding: a source
tensor the output does not hold, as itself or as the tensor it is tied to, fails the comparison.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import INDEX, SINGLE_FILE, read_index, weight_files
from ..mapping.steps import OutputSpec
from ..safetensors_io import TensorEntry, read_header
from ..sources.file_reads import CHUNK, Placed, pread_into
from .dist import Group, on_every_rank
from .plan import Plan, Runs, plan_layout
from .progress import Progress, shown as progress_shown
from .stream import read_in_place, run_plan


class ReferenceModel:
    """Name -> (file, data start, entry) for a HF folder with model.safetensors or a sharded index.

    Headers are validated (`read_header`); problems with the index are kept in `problems` and fail the
    comparison, so a broken index is reported beside broken tensors rather than instead of them.
    """

    def __init__(self, folder: Path):
        self.problems: list[str] = []
        self.fds: dict[str, int] = {}  # opened as tensors are read, one each
        self.opening = threading.Lock()  # the sink reads on the stream's two threads
        index_path = folder / INDEX
        index = read_index(index_path) if index_path.is_file() else None
        if index is None and not (folder / SINGLE_FILE).is_file():
            raise MergerError(f"folder has no {SINGLE_FILE} or {INDEX}, {folder}")
        self.entries: dict[str, tuple[str, int, TensorEntry]] = {}
        for file in weight_files(folder, index):
            path = str(file)
            start, entries, _ = read_header(path)
            for key, entry in entries.items():
                self.entries[key] = (path, start, entry)
        if index is not None:
            self._check_index(index)

    def _check_index(self, index: dict) -> None:
        weight_map = index["weight_map"]
        for name, file in weight_map.items():
            held = self.entries.get(name)
            if held is None or Path(held[0]).name != file:
                self.problems.append(f"index puts {name} in {file}, which does not hold it")
        for name in self.entries.keys() - weight_map.keys():
            self.problems.append(f"{Path(self.entries[name][0]).name} holds {name}, which the index lacks")
        total = sum(e.end - e.begin for _, _, e in self.entries.values())
        declared = (index.get("metadata") or {}).get("total_size")
        if declared is not None and declared != total:
            self.problems.append(f"index total_size is {declared}, the files hold {total} bytes")


    def read_into(self, name: str, first: int, out: torch.Tensor) -> None:
        """Fill the uint8 tensor `out` with tensor `name`'s bytes from its byte `first` on."""
        path, start, entry = self.entries[name]
        with self.opening:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
        at = start + entry.begin + first
        if pread_into(self.fds[path], memoryview(out.numpy()), at) < out.numel():
            raise MergerError(f"file ends inside tensor {name!r}, {path}")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


@dataclass
class Mismatch:
    name: str
    problem: str
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    bad: int = 0  # elements outside the tolerance
    numel: int = 0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def _differences(name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> Mismatch | None:
    """None when within tolerance. With atol = rtol = 0 "equal" means the same bytes (so -0.0 differs from 0.0)."""
    exact = atol == 0 and rtol == 0
    if exact and torch.equal(_bytes(ours), _bytes(ref)):
        return None  # the common case, without float64 copies
    a, b = ours.double(), ref.double()
    diff = (a - b).abs()
    if exact:
        bad = _bytes(ours).ne(_bytes(ref)).any(dim=1).reshape(ours.shape)
    else:  # allclose's rule; a NaN in both places is the same weight
        bad = ~(diff <= atol + rtol * b.abs()) & ~(a.isnan() & b.isnan())
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    rel = diff / b.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return Mismatch(name, "values differ", diff[bad].nan_to_num(float("inf")).max().item(),
                    rel[bad].nan_to_num(float("inf")).max().item(), n_bad, ours.numel())


def _combine(found: Mismatch, more: Mismatch) -> Mismatch:
    """One tensor's findings from two of its parts (chunks, ranks): a structural problem wins, counts add up."""
    if found.problem != "values differ" or more.problem != "values differ":
        return found if found.problem != "values differ" else more
    return Mismatch(found.name, found.problem, max(found.max_abs_diff, more.max_abs_diff),
                    max(found.max_rel_diff, more.max_rel_diff), found.bad + more.bad, found.numel)


@dataclass
class CompareSink:
    """Compares each output, whole or in parts, with the folder's tensor. `cast`: compare in the folder's dtype
    (`merger test`, whose reference may be stored in another dtype); otherwise the dtype itself must match
    (`--verify`). `aliases`: outputs compared with a folder tensor of another name (a tied lm_head, with the
    input embedding). Called from the stream's reading and writing threads at once."""

    reference: ReferenceModel
    atol: float = 0.0
    rtol: float = 0.0
    cast: bool = True
    aliases: dict[str, str] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)
    checked_bytes: int = 0
    mismatches: dict[str, Mismatch] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _label(self, spec: OutputSpec) -> str:
        name = self.aliases.get(spec.name)
        return spec.name if name is None else f"{spec.name} (left out as tied to {name})"

    def _found(self, found: Mismatch) -> None:
        with self.lock:
            held = self.mismatches.get(found.name)
            self.mismatches[found.name] = found if held is None else _combine(held, found)

    def _entry(self, spec: OutputSpec) -> TensorEntry | None:
        """The folder's tensor to compare `spec` with; None when there is none (a name the comparison of names
        reports, or an alias's missing target, reported here) or its shape or dtype is not `spec`'s."""
        name = self.aliases.get(spec.name, spec.name)
        held = self.reference.entries.get(name)
        if held is None:
            if spec.name in self.aliases:
                self._found(Mismatch(self._label(spec), "not in the folder"))
            return None
        entry = held[2]
        with self.lock:
            self.checked.add(spec.name)
        if tuple(entry.shape) != tuple(spec.shape):
            self._found(Mismatch(self._label(spec), f"shape {tuple(spec.shape)} vs {tuple(entry.shape)}"))
            return None
        if not self.cast and entry.dtype != spec.dtype:
            self._found(Mismatch(self._label(spec), f"dtype {spec.dtype} vs {entry.dtype}"))
            return None
        return entry

    def _compare_run(self, spec: OutputSpec, entry: TensorEntry, start: int, length: int,
                     ours: Callable[[int, int], torch.Tensor]) -> None:
        """Elements [start, start + length) of the output, `ours(lo, hi)` giving those [start + lo, start + hi),
        against the folder's, a chunk at a time."""
        step = max(1, CHUNK // max(spec.dtype.itemsize, entry.dtype.itemsize))
        item = entry.dtype.itemsize
        for lo in range(0, length, step):
            hi = min(length, lo + step)
            ref = torch.empty((hi - lo) * item, dtype=torch.uint8)
            self.reference.read_into(entry.name, (start + lo) * item, ref)
            found = _differences(self._label(spec), ours(lo, hi).to(entry.dtype), ref.view(entry.dtype),
                                 self.atol, self.rtol)
            if found is not None:
                found.numel = math.prod(spec.shape)
                self._found(found)
        with self.lock:
            self.checked_bytes += length * item

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        """A part of output `spec` in memory: its elements lie in `runs` of the tensor (plan.Runs)."""
        entry = self._entry(spec)
        if entry is None:
            return
        flat = piece.contiguous().reshape(-1)
        for k, start in enumerate(runs.starts()):
            at = k * runs.length
            self._compare_run(spec, entry, start, runs.length, lambda lo, hi, at=at: flat[at + lo:at + hi])

    def copy_part(self, spec: OutputSpec, runs: Runs, source: int, source_at: int, source_name: str) -> Placed:
        """A part of output `spec` the merge copies unchanged from the open source file `source`: compared from
        there a chunk at a time (stream.read_in_place), never held whole."""
        entry = self._entry(spec)

        def compare(index: int, chunk: torch.Tensor) -> None:
            if entry is not None:
                ours = chunk.view(spec.dtype)
                self._compare_run(spec, entry, index, ours.numel(), lambda lo, hi: ours[lo:hi])

        return read_in_place(runs, spec.dtype.itemsize, source, source_at, source_name, compare)


@dataclass
class CompareResult:
    ok: bool
    tensors: int
    bytes: int
    differ: int
    missing: int
    extra: int
    problems: list[str]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _table(mismatches: list[Mismatch], limit: int = 20) -> list[str]:
    """The worst mismatches first: structural problems (shape, dtype), then by largest absolute difference."""
    worst = sorted(mismatches, key=lambda m: (m.problem == "values differ", -m.max_abs_diff, m.name))[:limit]
    width = max([len(m.name) for m in worst] + [6])
    lines = [f"  {'tensor':<{width}}  {'max abs diff':>12}  {'max rel diff':>12}  {'bad elements':>20}  problem"]
    for m in worst:
        counts = f"{m.bad}/{m.numel}" if m.numel else "-"
        abs_d, rel_d = (f"{m.max_abs_diff:12.4g}", f"{m.max_rel_diff:12.4g}") if m.numel else (f"{'-':>12}",) * 2
        lines.append(f"  {m.name:<{width}}  {abs_d}  {rel_d}  {counts:>20}  {m.problem}")
    if len(mismatches) > limit:
        lines.append(f"  ... and {len(mismatches) - limit} more")
    return lines


def report(group: Group, sink: CompareSink, planned: set[str], reference: ReferenceModel,
           label: str = "test") -> CompareResult:
    """Gather every rank's findings; rank 0 prints the summary and, on failure, the worst mismatches."""
    gathered = group.all_gather((sorted(sink.checked), sink.checked_bytes, list(sink.mismatches.values())))
    by_name: dict[str, Mismatch] = {}
    for found in (m for g in gathered for m in g[2]):  # a tensor placed in parts is compared on several ranks
        by_name[found.name] = _combine(by_name[found.name], found) if found.name in by_name else found
    mismatches = list(by_name.values())
    missing = sorted(set(reference.entries) - planned)
    extra = sorted(planned - set(reference.entries))
    result = CompareResult(not (mismatches or missing or extra or reference.problems),
                           len(set().union(*(g[0] for g in gathered))), sum(g[1] for g in gathered),
                           len(mismatches), len(missing), len(extra), list(reference.problems))
    if group.rank == 0:
        print(f"merger {label}: {result.tensors} tensors ({result.bytes} bytes) compared, {result.differ} differ, "
              f"{result.missing} in the folder but not the merge, {result.extra} in the merge but not the folder, "
              f"{len(result.problems)} index problems")
        for problem in result.problems[:20]:
            print(f"  index:   {problem}")
        for name in missing[:20]:
            print(f"  missing: {name}")
        for name in extra[:20]:
            print(f"  extra:   {name}")
        if mismatches:
            print("\n".join(_table(mismatches)))
        print(f"merger {label}: {'PASSED' if result.ok else 'FAILED'}")
    return result


def compare_with_folder(plan: Plan, catalog: Catalog, group: Group, folder: Path, *, atol: float = 0.0,
                        rtol: float = 0.0, cast: bool = True, label: str = "test",
                        debug: bool = False, allow_overflow: bool = False) -> CompareResult:
    """Stream `plan` and compare every output with `folder` on every rank; the same result on all ranks."""
    reference = on_every_rank(group, lambda: ReferenceModel(Path(folder)), debug)
    try:
        aliases, compared = {}, plan
        if plan.tie is not None and plan.tie.kept is not None:  # the left-out lm_head, against the embedding
            aliases = {plan.tie.step.outputs[0].name: plan.tie.kept}
            compared = on_every_rank(group, lambda: plan_layout(catalog, [*plan.steps, plan.tie.step], plan.world,
                                                                plan.total_bytes, plan.max_inflight), debug)
        sink = CompareSink(reference, atol, rtol, cast, aliases)
        progress = Progress(compared.total_bytes, "comparing") if group.rank == 0 and progress_shown() else None
        run_plan(compared, catalog, group, sink, progress, debug, allow_overflow=allow_overflow)
    finally:
        reference.close()
    return report(group, sink, set(plan.weight_map), reference, label)
