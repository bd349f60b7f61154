"""The box each rank holds, from shape + mesh + placements, against DTensor's own computation."""
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from merger.sources.fsdp import shard_region


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    placements = tuple(draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, len(shape) - 1))))
                       for _ in mesh)
    coord = tuple(draw(st.integers(0, n - 1)) for n in mesh)
    return shape, mesh, coord, placements


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_region_matches_dtensor(layout):
    shape, mesh, coord, placements = layout
    sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
    ours_offsets, ours_sizes = shard_region(shape, mesh, coord, placements)
    assert ours_sizes == tuple(sizes)
    if all(s > 0 for s in sizes):  # torch reports an arbitrary offset for an empty shard
        assert ours_offsets == tuple(offsets)
