"""run_plan end to end in memory: the bytes the sink receives, read back by the safetensors library, equal what
torch computes from the whole source tensors; and every byte of every output file is written exactly once.

World 1 runs on merger's own one-process Group. A world of M runs as M threads of this process, whose
ThreadGroup (synthetic.py) carries the all_gather and the all_to_all of piece bytes instead of gloo: each thread
is one rank walking the same plan with its own reader, which may open only that rank's files.
"""
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors

from merger.catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from merger.engine.dist import Group
from merger.engine.plan import plan_layout, traffic
from merger.engine.stream import run_plan
from merger.mapping.steps import OutputSpec, Step
from tests.helpers.synthetic import (MemoryReader, MemorySink, Synthetic, plan_args, run_in_threads,
                                     single_tensor_steps, synthetics)

pytestmark = pytest.mark.unit


def _check_output(syn, plan, sink: MemorySink) -> None:
    for f, layout, data, writes in zip(plan.files, sink.layouts, sink.data, sink.writes):
        data_writes = writes[layout.data_start:]
        assert (data_writes == 1).all(), f"{f.name}: bytes written {set(data_writes)} times"
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


@pytest.mark.parametrize("world", [1, 2, 3])
def test_column_blocks_are_written_where_they_are_read(world):
    """Tensor-parallel column blocks (Megatron's row-parallel weights, DTensor Shard(1)), one per file: each
    rank casts the blocks it reads and writes them row by row at their offsets; no byte crosses ranks, and
    every byte lands once, equal to torch's cast of the whole tensor."""
    gen = torch.Generator().manual_seed(world)
    full = torch.randn(5, 1000, generator=gen)
    cuts = [(0, 300), (300, 700), (700, 1000)]
    store = {f"/synthetic/rank{i}.bin": {"w": full[:, lo:hi].clone()} for i, (lo, hi) in enumerate(cuts)}
    pieces = tuple(ShardPiece((0, lo), (5, hi - lo), (PieceCopy(f"/synthetic/rank{i}.bin", "w"),))
                   for i, (lo, hi) in enumerate(cuts))
    catalog = Catalog("synthetic", Path("/synthetic"), {"w": SourceTensor("w", (5, 1000), torch.float32, pieces)},
                      list(store), partial(MemoryReader, store=store))
    syn = Synthetic(catalog, [Step(("w",), (OutputSpec("w", (5, 1000), torch.bfloat16),))],
                    {"w": full.to(torch.bfloat16)})
    plan = plan_layout(catalog, syn.steps, world, 1 << 20, 1 << 20)
    assert plan.writers == [None]
    assert all(r["sent_bytes"] == r["received_bytes"] == 0 for r in traffic(plan))
    sink = MemorySink(plan)
    run_in_threads(world, lambda group: run_plan(plan, catalog, group, sink))
    _check_output(syn, plan, sink)


@pytest.mark.parametrize("world", [2, 4])
def test_a_step_is_written_by_the_rank_holding_its_inputs_while_writes_stay_even(world):
    """Experts of two EP ranks, each whole in its rank's file, each split into gate and up (a transform, so one
    rank writes the step): with as many merge ranks as files every expert is written where it is read and no
    byte crosses ranks; with more ranks than files the others take over experts so writing stays even."""
    gen = torch.Generator().manual_seed(world)
    experts = {f"experts.{e}.w": torch.randn(6, 4, generator=gen) for e in range(8)}
    files = ["/synthetic/rank0.bin", "/synthetic/rank1.bin"]
    store = {f: {} for f in files}
    tensors, steps, expected = {}, [], {}
    for e, (name, full) in enumerate(experts.items()):
        store[files[e // 4]][name] = full
        piece = ShardPiece((0, 0), (6, 4), (PieceCopy(files[e // 4], name),))
        tensors[name] = SourceTensor(name, (6, 4), torch.float32, (piece,))
        outputs = tuple(OutputSpec(f"{name}.{part}", (3, 4), torch.bfloat16) for part in ("gate", "up"))
        steps.append(Step((name,), outputs, lambda ts: list(torch.split(ts[0], 3))))
        expected.update({outputs[0].name: full[:3].to(torch.bfloat16), outputs[1].name: full[3:].to(torch.bfloat16)})
    catalog = Catalog("synthetic", Path("/synthetic"), tensors, files, partial(MemoryReader, store=store))
    plan = plan_layout(catalog, steps, world, 1 << 20, 1 << 20)
    moved, written = sum(r["sent_bytes"] for r in traffic(plan)), [r["written_bytes"] for r in traffic(plan)]
    if world == 2:
        assert moved == 0
    assert max(written) - min(written) <= 2 * 3 * 4 * 2  # within one expert's output
    sink = MemorySink(plan)
    run_in_threads(world, lambda group: run_plan(plan, catalog, group, sink))
    _check_output(Synthetic(catalog, steps, expected), plan, sink)


class _WholeTensorsOnly:
    """A sink that takes whole tensors only (no put_part): `put` records what it was handed."""

    def __init__(self):
        self.handed: list[str] = []

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        self.handed.append(spec.name)


def test_a_direct_plan_refuses_a_sink_without_parts_before_any_byte_moves():
    catalog, steps = single_tensor_steps(["a", "b"])
    direct = plan_layout(catalog, steps, 1, 1 << 30, 1 << 20)
    assert direct.direct
    sink = _WholeTensorsOnly()
    with pytest.raises(TypeError, match="_WholeTensorsOnly takes no parts"):
        run_plan(direct, catalog, Group(), sink)
    assert sink.handed == []
    assembled = plan_layout(catalog, steps, 1, 1 << 30, 1 << 20, direct=False)
    run_plan(assembled, catalog, Group(), sink)  # whole tensors are all an assembling plan hands over
    assert sorted(sink.handed) == ["a", "b"]
