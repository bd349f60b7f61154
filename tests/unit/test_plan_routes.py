"""A plan keeps its routes as columns (engine/routes.py) and makes Route objects only when asked. On random
synthetic checkpoints: the columns say what the Route objects say, a subset picked by the columns is the same
routes as the objects filtered one by one, the per-rank traffic is the sum over the Route objects, and a catalog
that makes its pieces only when asked (as the DCP catalog does) gets the same plan as one holding them."""
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merger.engine.plan import plan_layout, traffic
from tests.helpers.synthetic import plan_args, synthetics

pytestmark = pytest.mark.unit
SETTINGS = settings(max_examples=60, deadline=None)


def _plan(catalog, syn, args, direct=True):
    return plan_layout(catalog, syn.steps, args["world"], args["max_shard_size"], args["max_inflight"], direct)


@SETTINGS
@given(synthetics(), plan_args(), st.booleans(), st.randoms(use_true_random=False))
def test_columns_and_subsets_are_the_routes(syn, args, direct, rnd):
    plan = _plan(syn.catalog, syn, args, direct)
    for batch in plan.batches:
        routes = list(batch.routes)
        assert len(routes) == len(batch.routes)
        assert batch.routes.step.tolist() == [r.step for r in routes]
        assert batch.routes.reader.tolist() == [r.reader for r in routes]
        assert batch.routes.writer.tolist() == [r.writer for r in routes]
        assert batch.routes.nbytes.tolist() == [r.piece.numel * r.dtype.itemsize for r in routes]
        assert batch.routes.stored_nbytes().tolist() == [r.piece.numel * r.stored.itemsize for r in routes]
        positions = rnd.sample(range(len(routes)), rnd.randint(0, len(routes)))
        assert batch.routes.at(np.array(positions, dtype=np.int64)) == [routes[p] for p in positions]
        keep = [rnd.random() < 0.5 for _ in routes]
        assert list(batch.routes.where(np.array(keep, dtype=bool))) == [r for r, k in zip(routes, keep) if k]
        assert all(batch.routes[i] == r for i, r in enumerate(routes))


@SETTINGS
@given(synthetics(), plan_args(), st.booleans())
def test_traffic_is_the_sum_over_routes(syn, args, direct):
    plan = _plan(syn.catalog, syn, args, direct)
    want = [Counter(read_bytes=0, sent_bytes=0, received_bytes=0, written_bytes=0) for _ in range(plan.world)]
    for batch in plan.batches:
        for r in batch.routes:
            want[r.reader]["read_bytes"] += r.piece.numel * r.stored.itemsize
            if r.reader != r.writer:
                want[r.reader]["sent_bytes"] += r.nbytes
                want[r.writer]["received_bytes"] += r.nbytes
            if plan.writers[r.step] is None:
                want[r.writer]["written_bytes"] += r.nbytes
        for si in batch.steps:
            if plan.writers[si] is not None:
                want[plan.writers[si]]["written_bytes"] += sum(o.nbytes for o in plan.steps[si].outputs)
    assert traffic(plan) == [dict(w) for w in want]


class _Made(Sequence):
    """A tensor's pieces made anew each time they are asked for, as a catalog built from arrays makes them."""

    def __init__(self, pieces):
        self.pieces = pieces

    def __len__(self):
        return len(self.pieces)

    def __getitem__(self, i):
        made = tuple(replace(p, copies=tuple(replace(c) for c in p.copies)) for p in self.pieces)
        return made[i]


@SETTINGS
@given(synthetics(), plan_args(), st.booleans())
def test_pieces_made_when_asked_give_the_same_plan(syn, args, direct):
    lazy = replace(syn.catalog, tensors={n: replace(t, pieces=_Made(t.pieces)) for n, t in syn.catalog.tensors.items()})
    assert _plan(lazy, syn, args, direct) == _plan(syn.catalog, syn, args, direct)


class _Columns(Sequence):
    """A tensor's pieces, each with one copy, also given as arrays as the DCP catalog gives them
    (one_copy_columns): the planner then routes them without an object per piece."""

    def __init__(self, pieces, ndim, files):
        self.pieces, self.ndim, self.files = pieces, ndim, files

    def __len__(self):
        return len(self.pieces)

    def __getitem__(self, i):
        return self.pieces[i]

    def one_copy_columns(self):
        sizes = np.array([p.sizes for p in self.pieces], dtype=np.int64).reshape(len(self.pieces), self.ndim)
        file = np.array([self.files.index(p.copies[0].file) for p in self.pieces], dtype=np.int64)
        return sizes, file, self.files


@SETTINGS
@given(synthetics(), plan_args(), st.booleans(), st.randoms(use_true_random=False))
def test_pieces_given_as_arrays_give_the_same_plan(syn, args, direct, rnd):
    files = rnd.sample(syn.catalog.files, len(syn.catalog.files))  # the arrays' own file order
    tensors = {n: replace(t, pieces=_Columns(t.pieces, len(t.shape), files))
               if all(len(p.copies) == 1 for p in t.pieces) else t for n, t in syn.catalog.tensors.items()}
    arrays = replace(syn.catalog, tensors=tensors)
    assert _plan(arrays, syn, args, direct) == _plan(syn.catalog, syn, args, direct)
