"""Whether a model whose config ties its embeddings holds one tensor for both: the values decide, not the flag.

A config copied from a tied model, or edited by hand, says `tie_word_embeddings: true` over a checkpoint whose
lm_head was trained apart from the input embedding. Writing it tied would drop that lm_head: the output would
load with the input embedding in its place. So when the mapping writes both (`Mapping.tie`), the two are streamed
through the engine like any merge (same batches, same memory budget, any rank count) into a sink that checksums
them as they would be written; every rank gets every rank's checksums, so all reach the same answer before the
plan is fixed. Equal: lm_head is left out, as save_pretrained does. Different: both are written and the output's
config says `tie_word_embeddings: false` (the checkpoint's weights are the model, a copied flag is not), with a
note in the log; `--tie_word_embedding` asks for the tie whatever the values are, and is obeyed with a note (then
`--verify` fails: the output lacks the source's lm_head).

What is compared is the CRC-32 of each run of elements a rank is handed (a row block, a row of a column block, a
1 MiB chunk of a piece read where it lies), keyed by the run's first element. Sharded alike (the usual case:
both are [vocab, hidden] and cut the same way), the two tensors give the same keys, and one CRC that differs
proves a difference; a trained-apart lm_head differs in every run, so taking it for the embedding would
need every one of its CRCs to collide. Cut differently, the runs' CRCs are combined into each tensor's
whole CRC (crc32_combine) and those are compared. CRC-32 runs at gigabytes a second (sources/crc32.py), so a
tied model's merge costs little more than reading its embedding twice more. `--verify` compares the left-out lm_head's source
values with the output element by element.
"""
from __future__ import annotations

import dataclasses

import torch

from ..catalog import Catalog
from ..mapping.steps import Mapping, OutputSpec, Tie
from ..options import MergeOptions
from ..sources.crc32 import crc32, crc32_combine
from ..sources.file_reads import Placed
from .dist import Group, on_every_rank
from .plan import Runs, plan_layout
from .stream import read_in_place, run_plan


class ChecksumSink:
    """The CRC-32 of every run of each output this rank is handed: name -> {first element: (elements, crc)}."""

    def __init__(self):
        self.runs: dict[str, dict[int, tuple[int, int]]] = {}

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        data = memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
        size = runs.length * piece.element_size()
        found = self.runs.setdefault(spec.name, {})
        for k, start in enumerate(runs.starts()):
            found[start] = (runs.length, crc32(data[k * size:(k + 1) * size]))

    def copy_part(self, spec: OutputSpec, runs: Runs, source: int, source_at: int, source_name: str) -> Placed:
        """A part the merge would copy unchanged from the source file: checksummed from there a chunk at a time
        (stream.read_in_place), so the check holds no batch of it either."""
        item = spec.dtype.itemsize
        return read_in_place(runs, item, source, source_at, source_name, lambda index, chunk: self.put_part(
            spec, Runs(index, chunk.numel() // item), chunk.view(spec.dtype)))


def _whole_crc(runs: dict[int, tuple[int, int]], item: int) -> int:
    """The CRC-32 of a tensor's bytes from the CRCs of the runs that tile it."""
    crc = 0
    for start in sorted(runs):
        count, part = runs[start]
        crc = crc32_combine(crc, part, count * item)
    return crc


def _same_values(catalog: Catalog, tie: Tie, kept, group: Group, options: MergeOptions) -> bool:
    """Whether lm_head and the input embedding would be written with the same bytes, streamed on every rank."""
    plan = on_every_rank(group, lambda: plan_layout(catalog, [tie.step, kept], group.world, options.max_shard_size,
                                                    options.max_inflight), options.debug)
    sink = ChecksumSink()
    # A float16 overflow is the merge's to report, once, after this check.
    run_plan(plan, catalog, group, sink, debug=options.debug, allow_overflow=True)
    shares = group.all_gather(sink.runs)
    head, embedding = ({start: run for share in shares for start, run in share.get(name, {}).items()}
                       for name in (tie.step.outputs[0].name, tie.kept))
    if head.keys() == embedding.keys():
        return head == embedding
    item = tie.step.outputs[0].dtype.itemsize
    return _whole_crc(head, item) == _whole_crc(embedding, item)


def settle_tie(mapping: Mapping, catalog: Catalog, group: Group, options: MergeOptions) -> Mapping:
    """The mapping with lm_head left out only when its values are the input embedding's (or asked to be, by
    --tie_word_embedding); otherwise written, with `tie_word_embeddings: false` in the output's config. Called on
    every rank together: the comparison is a collective, and all ranks get the same answer."""
    tie = mapping.tie
    if tie is None or tie.kept is None:
        return mapping  # no input embedding the policy knows: nothing to compare with
    head = tie.step.outputs[0]
    kept = next(s for s in mapping.steps if any(o.name == tie.kept for o in s.outputs))
    kept_spec = next(o for o in kept.outputs if o.name == tie.kept)
    if (kept_spec.shape, kept_spec.dtype) == (head.shape, head.dtype) and _same_values(catalog, tie, kept, group,
                                                                                       options):
        return mapping
    differ = f"the checkpoint's {head.name} differs from its {tie.kept}"
    if options.tie_word_embedding:
        note = (f"merger: --tie_word_embedding: {differ}; {head.name} is left out as asked, and the output's "
                f"lm_head is {tie.kept} (--verify fails on it)")
        return dataclasses.replace(mapping, notes=(*mapping.notes, note))
    source = mapping.hf_dir / "config.json" if mapping.hf_dir else "config.json"
    note = (f"merger: warning: {source} ties the embeddings (tie_word_embeddings), but {differ}: both are "
            f"written, and the output's config.json says tie_word_embeddings: false")
    return dataclasses.replace(mapping, steps=[*mapping.steps, tie.step], tie=None, notes=(*mapping.notes, note),
                               config_updates={**mapping.config_updates, "tie_word_embeddings": False})
