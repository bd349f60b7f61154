"""Properties of plan_layout on random synthetic checkpoints, for any merge world from 1 to 8: every output byte
has exactly one place, every piece one route from the rank that opened its file, every batch within its
budget, and the plan a function of its inputs alone (so every rank computes the same one)."""
import json
import math
import struct
from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merger.engine.plan import MIN_RUN_BYTES, Plan, plan_layout, rerouted, traffic
from merger.engine.routes import Route
from merger.output.safetensors_layout import file_layout
from tests.helpers.synthetic import plan_args, single_tensor_steps, synthetics

pytestmark = pytest.mark.unit
SETTINGS = settings(max_examples=80, deadline=None)


def _plan(syn, args, direct=True) -> Plan:
    return plan_layout(syn.catalog, syn.steps, args["world"], args["max_shard_size"], args["max_inflight"], direct)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@SETTINGS
@given(synthetics(), plan_args())
def test_every_output_byte_has_exactly_one_place(syn, args):
    plan = _plan(syn, args)
    specs = {o.name: o for s in syn.steps for o in s.outputs}
    assert sorted(o.name for s in plan.steps for o in s.outputs) == sorted(specs)  # each step once
    placed = Counter()
    for index, f in enumerate(plan.files):
        # the header as a safetensors reader sees it: its length, then JSON naming each tensor's data range
        layout = file_layout(f)
        (length,) = struct.unpack("<Q", layout.header[:8])
        assert layout.data_start == len(layout.header) == 8 + length
        header = json.loads(layout.header[8:])
        header.pop("__metadata__")
        at = 0
        for entry in sorted(f.entries, key=lambda e: e.begin):  # the data region tiled: no gap, no overlap
            assert entry.begin == at and entry.end - entry.begin == _nbytes(entry.shape, entry.dtype)
            assert header.pop(entry.name)["data_offsets"] == [entry.begin, entry.end]
            assert plan.location[entry.name] == (index, entry)
            at = entry.end
            placed[entry.name] += 1
        assert header == {} and f.data_bytes == at and layout.size == layout.data_start + at
        spec = [specs[e.name] for e in f.entries]
        assert all((e.shape, e.dtype) == (s.shape, s.dtype) for e, s in zip(f.entries, spec))
        assert all(s.file == (None if f.indexed else f.name) for s in spec)  # side files hold their own only
    assert placed == Counter(list(specs))
    assert plan.total_bytes == sum(s.nbytes for s in specs.values())


@SETTINGS
@given(synthetics(), plan_args())
def test_model_files_follow_max_shard_size(syn, args):
    """A file takes outputs in order while they fit in max_shard_size; one output larger than that fills a file
    alone. So every file fits or holds one tensor, and no file's first tensor would have fit in the one before."""
    plan, limit = _plan(syn, args), args["max_shard_size"]
    files = plan.model_files
    count = len(files)
    assert [f.name for f in files] == (["model.safetensors"] if count == 1 else
                                       [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)])
    data = [f.data_bytes for f in files]
    assert all(size <= limit or len(f.entries) == 1 for f, size in zip(files, data))
    for before, after, size in zip(files, files[1:], data):
        assert size + (after.entries[0].end - after.entries[0].begin) > limit
    assert all(f.entries for f in plan.files)


def _held(plan: Plan, si: int, routes: list[Route]) -> list[int]:
    """What each rank holds for step `si`, as plan.py's budget counts it: a piece placed directly at its reader;
    else, at the writer, the inputs assembled and the outputs, plus each piece that crosses ranks at both ends."""
    held, writer = [0] * plan.world, plan.writers[si]
    for r in routes:
        size = _nbytes(r.piece.sizes, r.dtype)
        if writer is None:
            held[r.reader] += size
        else:
            held[writer] += size
            if r.reader != writer:
                held[r.reader] += size
                held[writer] += size
    if writer is not None:
        held[writer] += sum(_nbytes(o.shape, o.dtype) for o in plan.steps[si].outputs)
    return held


@SETTINGS
@given(synthetics(), plan_args())
def test_each_rank_within_its_batch_budget(syn, args):
    """Two batches are in flight at once, so a batch gets half of max_inflight on every rank. Batches are runs of
    consecutive steps, each as long as the budget allows; a step that alone exceeds it makes a batch alone."""
    plan = _plan(syn, args)
    budget = args["max_inflight"] // 2
    assert [si for b in plan.batches for si in b.steps] == list(range(len(plan.steps)))
    held = []
    for batch in plan.batches:
        by_step = {si: [r for r in batch.routes if r.step == si] for si in batch.steps}
        assert sum(map(len, by_step.values())) == len(batch.routes)
        assert batch.out_bytes == sum(o.nbytes for si in batch.steps for o in plan.steps[si].outputs)
        per_step = [_held(plan, si, by_step[si]) for si in batch.steps]
        total = [sum(col) for col in zip(*per_step)]
        if len(batch.steps) > 1:
            assert max(total) <= budget, (total, budget)
        held.append((total, per_step[0]))
    for (before, _), (_, first_after) in zip(held, held[1:]):  # the next step would not have fitted
        assert any(a + b > budget for a, b in zip(before, first_after))


@SETTINGS
@given(synthetics(), plan_args(), st.randoms(use_true_random=False))
def test_same_plan_whatever_the_order_of_steps_and_tensors(syn, args, rnd):
    """Every rank computes the plan alone: it must be a function of the catalog and the set of steps (the steps'
    order is not a fact of the checkpoint: the plan sorts them), not of list or dict order."""
    plan = _plan(syn, args)
    assert _plan(syn, args) == plan
    shuffled_steps = rnd.sample(syn.steps, len(syn.steps))
    names = rnd.sample(list(syn.catalog.tensors), len(syn.catalog.tensors))
    shuffled_catalog = replace(syn.catalog, tensors={n: syn.catalog.tensors[n] for n in names})
    again = plan_layout(shuffled_catalog, shuffled_steps, args["world"], args["max_shard_size"],
                        args["max_inflight"])
    assert again == plan


@SETTINGS
@given(synthetics(), plan_args(), st.booleans())
def test_every_piece_routed_once_from_the_rank_that_opened_its_file(syn, args, direct):
    plan, world = _plan(syn, args, direct), args["world"]
    owner = {f: i % world for i, f in enumerate(syn.catalog.files)}  # rank i of M opens files i, i + M, ...
    assert syn.catalog.file_owner(world) == owner
    routes = [r for b in plan.batches for r in b.routes]
    wanted = Counter((si, ii, p) for si, s in enumerate(plan.steps) for ii, name in enumerate(s.inputs)
                     for p in syn.catalog.tensors[name].pieces)
    assert Counter((r.step, r.input, r.piece) for r in routes) == wanted
    for r in routes:
        step, tensor = plan.steps[r.step], syn.catalog.tensors[plan.steps[r.step].inputs[r.input]]
        writer = plan.writers[r.step]
        assert r.copy in r.piece.copies and r.reader == owner[r.copy.file]
        assert r.writer == (r.reader if writer is None else writer)
        # a writer that opened a copy itself reads that one: the piece never crosses ranks
        if writer is not None and any(owner[c.file] == writer for c in r.piece.copies):
            assert r.reader == writer
        cast = step.is_cast and len(step.inputs) == len(step.outputs) == 1
        assert r.stored == tensor.dtype and r.dtype == (step.outputs[0].dtype if cast else tensor.dtype)
    for si, step in enumerate(plan.steps):
        # placed directly exactly when a pure cast's pieces tile the tensor, each one run of its row-major bytes or
        # runs long enough to be written one by one
        tensor = syn.catalog.tensors[step.inputs[0]]
        cast = direct and step.is_cast and len(step.inputs) == len(step.outputs) == 1
        if math.prod(tensor.shape) == 0:  # no bytes: placed either way, nothing is written
            assert cast or plan.writers[si] is not None
        else:
            runs = cast and sum(p.numel for p in tensor.pieces) == math.prod(tensor.shape) and \
                all(_placeable(tensor.shape, p, step.outputs[0].dtype.itemsize) for p in tensor.pieces)
            assert (plan.writers[si] is None) == runs
        assert plan.writers[si] is None or 0 <= plan.writers[si] < world


def _placeable(shape, piece, itemsize: int) -> bool:
    """The piece's elements are one run of consecutive indices in the row-major tensor, or runs of at least
    MIN_RUN_BYTES each (counted by torch, element by element)."""
    box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
    index = torch.arange(math.prod(shape)).reshape(shape)[box].reshape(-1)
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).reshape(-1)
    lengths = torch.diff(torch.cat([torch.tensor([-1]), breaks, torch.tensor([index.numel() - 1])]))
    return len(lengths) == 1 or bool((lengths * itemsize >= MIN_RUN_BYTES).all())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=8, unique=True),
       st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True))
def test_any_names_plan_and_layer_numbers_sort_as_numbers(names, layers):
    """Output names are whatever the checkpoint's keys are: any text plans. Files hold tensors in layer order,
    'layers.10' after 'layers.9'."""
    catalog, steps = single_tensor_steps(list(dict.fromkeys(names + [f"layers.{n}.w" for n in layers])))
    plan = plan_layout(catalog, steps, 1, 1 << 30, 1 << 30)
    order = [e.name for f in plan.files for e in f.entries if e.name.startswith("layers.") and e.name.endswith(".w")]
    numbered = [f"layers.{n}.w" for n in sorted(layers)]
    assert [n for n in order if n in numbered] == numbered


@SETTINGS
@given(synthetics(), plan_args(), plan_args(), st.booleans())
def test_rerouted_plan_is_the_plan_for_that_world(syn, args, other, direct):
    """`inspect --merge_ranks` reroutes a plan for another world: the result is the plan that world would have
    made itself, and its traffic writes every output byte once and receives what is sent."""
    plan = _plan(syn, args, direct)
    again = rerouted(plan, syn.catalog, other["world"])
    assert again == _plan(syn, dict(args, world=other["world"]), direct)
    ranks = traffic(again)
    assert sum(r["written_bytes"] for r in ranks) == again.total_bytes
    assert sum(r["sent_bytes"] for r in ranks) == sum(r["received_bytes"] for r in ranks)
