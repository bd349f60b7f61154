"""Streaming comparison of a merge with a HF folder: `merger test` against a reference, `merge --verify` against
the freshly written output. One code path for both.

The plan is run again with a `CompareSink` instead of the file writer: each writing rank compares what it
would write with the folder's tensor of that name, read alone with pread, so the check is as flat in
memory as the merge. The folder itself is checked first: every safetensors header valid, the index's
entries in the files it names, total_size right. Rank 0 gathers the findings and prints the worst.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import INDEX, SINGLE_FILE, read_index, weight_files
from ..mapping.steps import OutputSpec
from ..safetensors_io import TensorEntry, read_header, read_tensor
from .dist import Group, on_every_rank
from .plan import Plan, rerouted
from .progress import Progress
from .stream import run_plan


class ReferenceModel:
    """Name -> (file, data start, entry) for a HF folder with model.safetensors or a sharded index.

    Headers are validated (`read_header`); problems with the index are kept in `problems` and fail the
    comparison, so a broken index is reported beside broken tensors rather than instead of them.
    """

    def __init__(self, folder: Path):
        self.problems: list[str] = []
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

    def read(self, name: str) -> torch.Tensor:
        path, start, entry = self.entries[name]
        return read_tensor(path, start, entry)


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


@dataclass
class CompareSink:
    """Compares each output with the folder's tensor. `cast`: compare in the folder's dtype (`merger test`,
    whose reference may be stored in another dtype); otherwise the dtype itself must match (`--verify`)."""

    reference: ReferenceModel
    atol: float = 0.0
    rtol: float = 0.0
    cast: bool = True
    checked: int = 0
    checked_bytes: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        if spec.name not in self.reference.entries:
            return  # reported once by the name comparison on rank 0
        ref = self.reference.read(spec.name)
        self.checked += 1
        self.checked_bytes += ref.numel() * ref.element_size()
        if tuple(ref.shape) != tuple(tensor.shape):
            self.mismatches.append(Mismatch(spec.name, f"shape {tuple(tensor.shape)} vs {tuple(ref.shape)}"))
            return
        if not self.cast and ref.dtype != tensor.dtype:
            self.mismatches.append(Mismatch(spec.name, f"dtype {tensor.dtype} vs {ref.dtype}"))
            return
        found = _differences(spec.name, tensor.to(ref.dtype), ref, self.atol, self.rtol)
        if found:
            self.mismatches.append(found)


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
    gathered = group.all_gather((sink.checked, sink.checked_bytes, sink.mismatches))
    mismatches = [m for g in gathered for m in g[2]]
    missing = sorted(set(reference.entries) - planned)
    extra = sorted(planned - set(reference.entries))
    result = CompareResult(not (mismatches or missing or extra or reference.problems),
                           sum(g[0] for g in gathered), sum(g[1] for g in gathered), len(mismatches),
                           len(missing), len(extra), list(reference.problems))
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
    sink = CompareSink(reference, atol, rtol, cast)
    progress = Progress(plan.total_bytes, "comparing") if group.rank == 0 else None
    whole = rerouted(plan, catalog, direct=False)  # each tensor compared whole, by one rank
    run_plan(whole, catalog, group, sink, progress, debug, allow_overflow=allow_overflow)
    return report(group, sink, set(plan.weight_map), reference, label)
