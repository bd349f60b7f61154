"""Whether a model whose config ties its embeddings holds one tensor for both: the values decide, not the flag.

A config copied from a tied model, or edited by hand, says `tie_word_embeddings: true` over a checkpoint whose
lm_head was trained apart from the input embedding. Writing it tied would drop that lm_head: the output would
load with the input embedding in its place. So when the mapping writes both (`Mapping.tie`), the two are
streamed through the engine like any merge (same batches, same memory budget, any rank count) into a sink
that fingerprints them as they would be written; every rank gets the same sums and the same answer before
the plan is fixed. Equal: lm_head is left out, as save_pretrained does. Different: both are written and the
output's config says `tie_word_embeddings: false` (the checkpoint's weights are the model, a copied flag is
not), with a note in the log; `--tie_word_embedding` asks for the tie whatever the values are, and is obeyed
with a note (then `--verify` fails: the output lacks the source's lm_head).

The fingerprint of a tensor is the sum, modulo 2^64, of a mixed 64-bit hash of each element's bits and its
row-major position: a sum does not depend on how the elements are split into pieces, ranks and batches,
and two tensors with the same bits at the same places have the same one. Different tensors share it with a
chance of about 2^-64; `--verify` compares the kept lm_head's source values with the output element by
element.
"""
from __future__ import annotations

import dataclasses

import torch

from ..catalog import Catalog
from ..mapping.steps import Mapping, OutputSpec, Tie
from ..options import MergeOptions
from .dist import Group, on_every_rank
from .plan import Runs, plan_layout
from .stream import run_plan

_MASK = (1 << 64) - 1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ELEMENTS = 1 << 18  # elements hashed at once: a few MiB of int64 temporaries


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's constants; torch's int64 arithmetic wraps, so products and sums are taken modulo 2^64.
_GOLDEN, _MIX1, _MIX2 = map(_signed, (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x >> n as unsigned 64-bit (torch shifts int64 arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _hash_sum(bits: torch.Tensor, index: torch.Tensor) -> int:
    """The sum of splitmix64(bits + index * golden) over the elements, modulo 2^64."""
    x = bits.to(torch.int64) + index * _GOLDEN
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    x = x ^ _shift(x, 31)
    return int(x.sum()) & _MASK


class FingerprintSink:
    """Sums each output's element hashes (see the module's docstring) over the parts this rank is given."""

    def __init__(self):
        self.sums: dict[str, int] = {}

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        flat = piece.contiguous().reshape(-1)
        bits = flat.view(_BITS[flat.element_size()])
        total = self.sums.get(spec.name, 0)
        per_group = max(1, _ELEMENTS // max(runs.length, 1))  # whole runs hashed together, or one run in slices
        starts = torch.tensor(list(runs.starts()), dtype=torch.int64)
        for g in range(0, len(starts), per_group):
            group = starts[g:g + per_group]
            rows = bits[g * runs.length:(g + len(group)) * runs.length].view(len(group), runs.length)
            for lo in range(0, runs.length, _ELEMENTS):
                hi = min(runs.length, lo + _ELEMENTS)
                index = (group[:, None] + torch.arange(lo, hi)).reshape(-1)
                total += _hash_sum(rows[:, lo:hi].reshape(-1), index)
        self.sums[spec.name] = total & _MASK


def _same_values(catalog: Catalog, tie: Tie, kept, group: Group, options: MergeOptions) -> bool:
    """Whether lm_head and the input embedding would be written with the same bytes, streamed on every rank."""
    plan = on_every_rank(group, lambda: plan_layout(catalog, [tie.step, kept], group.world, options.max_shard_size,
                                                    options.max_inflight), options.debug)
    sink = FingerprintSink()
    # A float16 overflow is the merge's to report, once, after this check.
    run_plan(plan, catalog, group, sink, debug=options.debug, allow_overflow=True)
    gathered = group.all_gather(sink.sums)
    head, embedding = (sum(sums.get(name, 0) for sums in gathered) & _MASK for name in (tie.step.outputs[0].name,
                                                                                        tie.kept))
    return head == embedding


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
