"""run_plan end to end in memory: the bytes the sink receives, read back by the safetensors library, equal what
torch computes from the whole source tensors; and every byte of every output file is written exactly once.

World 1 runs on merger's own one-process Group. A world of M runs as M threads of this process, whose
ThreadGroup (synthetic.py) carries the all_gather and the all_to_all of piece bytes instead of gloo: each thread
is one rank walking the same plan with its own reader, which may open only that rank's files.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors
from synthetic import MemorySink, plan_args, run_in_threads, synthetics

from merger.engine.dist import Group
from merger.engine.plan import plan_layout
from merger.engine.stream import run_plan

pytestmark = pytest.mark.unit


def _check_output(syn, plan, sink: MemorySink) -> None:
    for f, data, writes in zip(plan.files, sink.data, sink.writes):
        assert (writes[len(f.prefix):] == 1).all(), f"{f.name}: bytes written {set(writes[len(f.prefix):])} times"
        written = load_safetensors(bytes(data))
        assert sorted(written) == sorted(e.name for e in f.entries)
        for name, tensor in written.items():
            want = syn.expected[name]
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor, want), name


@settings(max_examples=60, deadline=None)
@given(synthetics(), plan_args(), st.booleans())
def test_one_rank_writes_what_torch_computes(syn, args, direct):
    plan = plan_layout(syn.catalog, syn.steps, 1, args["max_shard_size"], args["max_inflight"], direct)
    sink = MemorySink(plan)
    run_plan(plan, syn.catalog, Group(), sink)
    _check_output(syn, plan, sink)


@settings(max_examples=40, deadline=None)
@given(synthetics(), plan_args(min_world=2), st.booleans())
def test_m_thread_ranks_write_what_torch_computes(syn, args, direct):
    plan = plan_layout(syn.catalog, syn.steps, args["world"], args["max_shard_size"], args["max_inflight"], direct)
    sink = MemorySink(plan)
    run_in_threads(args["world"], lambda group: run_plan(plan, syn.catalog, group, sink))
    _check_output(syn, plan, sink)
