"""Outputs written in slabs (OutputSpec.rows): HF's experts stacked [E, ...] in one tensor, each expert's rows made
and written by a step of its own, so no rank holds the whole stack.

Oracle: safetensors' own save_file of the stack torch builds from the whole experts (torch.stack), byte for byte,
and its load of what was written; the steps never see more than one expert.
"""
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from merger.catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from merger.engine.plan import plan_layout
from merger.engine.stream import run_plan
from merger.errors import MergerError
from merger.mapping.steps import OutputSpec, Step
from merger.output.files import FileSink, prepare_files
from tests.helpers.synthetic import MemoryReader, run_in_threads

pytestmark = pytest.mark.unit

EXPERTS, FILES = 4, ["/synthetic/rank0.bin", "/synthetic/rank1.bin"]  # two EP ranks, two experts each
WEIGHT, BIAS, NORM = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias", \
    "model.layers.0.post_attention_layernorm.weight"


def _one_expert(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """An expert's fc1 [out, in] as its slab [1, in, out] of the stack (transposed: written in row-major order)."""
    (t,) = tensors
    assert t.dim() == 2, "a slab step is handed one expert"
    return [t.t().unsqueeze(0)]


def _one_bias(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[0].unsqueeze(0)]


def _checkpoint():
    """Per expert a [6, 4] weight and a [6] bias, each whole in its EP rank's file, and a norm: the catalog, the
    slab steps, and each output as torch builds it from the whole tensors."""
    gen = torch.Generator().manual_seed(0)
    store = {f: {} for f in FILES}
    tensors, steps = {}, []
    weights, biases = [], []
    for e in range(EXPERTS):
        file = FILES[e // 2]
        for kind, shape, fn, out, held in (("weight", (6, 4), _one_expert, (WEIGHT, (EXPERTS, 4, 6)), weights),
                                           ("bias", (6,), _one_bias, (BIAS, (EXPERTS, 6)), biases)):
            name = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.{kind}"
            held.append(store[file].setdefault(name, torch.randn(shape, generator=gen)))
            piece = ShardPiece((0,) * len(shape), shape, (PieceCopy(file, name),))
            tensors[name] = SourceTensor(name, shape, torch.float32, (piece,))
            steps.append(Step((name,), (OutputSpec(*out, torch.bfloat16, rows=(e, e + 1)),), fn))
    store[FILES[0]]["norm"] = norm = torch.randn(4, generator=gen)
    norm_piece = ShardPiece((0,), (4,), (PieceCopy(FILES[0], "norm"),))
    tensors["norm"] = SourceTensor("norm", (4,), torch.float32, (norm_piece,))
    steps.append(Step(("norm",), (OutputSpec(NORM, (4,), torch.bfloat16),)))
    catalog = Catalog("synthetic", Path("/synthetic"), tensors, FILES, partial(MemoryReader, store=store))
    expected = {WEIGHT: torch.stack(weights).transpose(1, 2).contiguous().to(torch.bfloat16),
                BIAS: torch.stack(biases).to(torch.bfloat16), NORM: norm.to(torch.bfloat16)}
    return catalog, steps, expected


def _merge(tmp_path: Path, world: int, max_shard_size: int, max_inflight: int):
    catalog, steps, expected = _checkpoint()
    plan = plan_layout(catalog, steps, world, max_shard_size, max_inflight)
    prepare_files(tmp_path, plan)

    def rank(group):
        sink = FileSink(tmp_path, plan)
        try:
            run_plan(plan, catalog, group, sink)
        finally:
            sink.close()

    run_in_threads(world, rank)
    return plan, expected


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("max_inflight", [0, 1 << 20])  # a batch per step, or one batch
def test_a_stack_written_in_slabs_is_the_file_safetensors_writes_for_the_whole_stack(tmp_path, world, max_inflight):
    plan, expected = _merge(tmp_path, world, 1, max_inflight)  # a tensor per file
    assert len(plan.files) == 3 and len(plan.location) == 3  # each stack is one tensor, one header entry
    slab = {WEIGHT: 4 * 6 * 2, BIAS: 6 * 2}
    assert all(o.nbytes == slab[o.name] for s in plan.steps for o in s.outputs if o.name in slab)
    for f in plan.files:
        (name,) = [e.name for e in f.entries]
        save_file({name: expected[name]}, tmp_path / "own.safetensors", metadata={"format": "pt"})
        assert (tmp_path / f.name).read_bytes() == (tmp_path / "own.safetensors").read_bytes(), name


@pytest.mark.parametrize("world", [1, 2])
def test_slabs_beside_other_tensors_in_one_file_load_as_the_stack(tmp_path, world):
    plan, expected = _merge(tmp_path, world, 1 << 20, 64)
    assert len(plan.files) == 1 and len(plan.batches) > 1
    written = load_file(tmp_path / plan.files[0].name)
    assert written.keys() == expected.keys() and all(torch.equal(written[n], expected[n]) for n in expected)


@pytest.mark.parametrize("rows", [[(0, 1), (1, 2), (3, 4)], [(0, 2), (1, 4)], [(0, 1), (1, 4), (4, 5)]])
def test_slabs_that_do_not_tile_their_tensor_are_refused(rows):
    catalog, _, _ = _checkpoint()
    name = next(iter(catalog.tensors))
    steps = [Step((name,), (OutputSpec(WEIGHT, (EXPERTS, 4, 6), torch.bfloat16, rows=r),), _one_expert) for r in rows]
    with pytest.raises(MergerError, match="do not tile its 4 rows"):
        plan_layout(catalog, steps, 1, 1 << 20, 1 << 20)


def test_a_slab_and_a_whole_tensor_of_one_name_are_two_sources_for_it():
    catalog, _, _ = _checkpoint()
    name = next(iter(catalog.tensors))
    spec = OutputSpec(WEIGHT, (EXPERTS, 4, 6), torch.bfloat16)
    steps = [Step((name,), (spec,)), Step((name,), (OutputSpec(WEIGHT, spec.shape, spec.dtype, rows=(0, 1)),))]
    with pytest.raises(MergerError, match=f"two source tensors map to output {WEIGHT}"):
        plan_layout(catalog, steps, 1, 1 << 20, 1 << 20)
