"""`merger test`: stream the merge and compare each output tensor with a reference HF folder, writing nothing.

The reference's tensors are read one at a time (pread of its safetensors), so the check is as flat in memory
as the merge itself. Each writing rank compares what it would have written; rank 0 gathers the findings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .dist import Group
from .errors import MergerError
from .plan import OutputSpec
from .safetensors_io import TensorEntry, read_header, read_tensor


class ReferenceModel:
    """Name -> (file, data start, entry) for a HF folder with model.safetensors or a sharded index."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise MergerError(f"reference folder has no model.safetensors or index, {folder}")
        self.entries: dict[str, tuple[str, int, TensorEntry]] = {}
        for name in files:
            path = str(folder / name)
            start, entries, _ = read_header(path)
            for key, entry in entries.items():
                self.entries[key] = (path, start, entry)

    def read(self, name: str) -> torch.Tensor:
        path, start, entry = self.entries[name]
        return read_tensor(path, start, entry)


@dataclass
class Mismatch:
    name: str
    problem: str
    max_abs_diff: float = 0.0


@dataclass
class CompareSink:
    reference: ReferenceModel
    atol: float
    rtol: float
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
            self.mismatches.append(Mismatch(spec.name, f"shape {tuple(tensor.shape)} vs reference {tuple(ref.shape)}"))
            return
        ours = tensor.to(ref.dtype)
        if self.atol == 0 and self.rtol == 0:
            same = torch.equal(ours, ref)
        else:
            same = torch.allclose(ours.double(), ref.double(), atol=self.atol, rtol=self.rtol)
        if not same:
            diff = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
            self.mismatches.append(Mismatch(spec.name, "values differ", diff))


def report(group: Group, sink: CompareSink, planned: set[str], reference: ReferenceModel) -> bool:
    """Gather every rank's findings on rank 0, print the summary there; True when everything matched."""
    mine = (sink.checked, sink.checked_bytes, [(m.name, m.problem, m.max_abs_diff) for m in sink.mismatches])
    if group.distributed:
        import torch.distributed as dist

        gathered: list = [None] * group.world
        dist.all_gather_object(gathered, mine, group=group.control)
    else:
        gathered = [mine]
    checked = sum(g[0] for g in gathered)
    nbytes = sum(g[1] for g in gathered)
    mismatches = [Mismatch(*m) for g in gathered for m in g[2]]
    missing = sorted(set(reference.entries) - planned)
    extra = sorted(planned - set(reference.entries))
    ok = not (mismatches or missing or extra)
    if group.rank == 0:
        print(f"merger test: {checked} tensors ({nbytes} bytes) compared, {len(mismatches)} differ, "
              f"{len(missing)} missing from the merge, {len(extra)} not in the reference")
        for name in missing[:20]:
            print(f"  missing: {name}")
        for name in extra[:20]:
            print(f"  extra:   {name}")
        for m in sorted(mismatches, key=lambda m: -m.max_abs_diff)[:20]:
            print(f"  differs: {m.name}: {m.problem}" + (f" (max abs diff {m.max_abs_diff:.3g})" if m.max_abs_diff else ""))
        print("merger test: PASSED" if ok else "merger test: FAILED")
    return ok
