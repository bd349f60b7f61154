"""The tie check's checksums: runs of a tensor cut any way combine into the CRC-32 zlib computes over its bytes,
so an lm_head and an input embedding sharded differently are still compared by their values."""
import zlib

import pytest
import torch

from merger.catalog import ShardPiece
from merger.engine.plan import block_runs
from merger.engine.tie_check import ChecksumSink, _whole_crc
from merger.mapping.steps import OutputSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cuts", [[(0, 3), (3, 10)], [(0, 10)], [(0, 1), (1, 2), (2, 7), (7, 10)]])
def test_column_blocks_combine_into_the_tensors_crc(cuts):
    """Column blocks (one run per row, as Shard(1) pieces are placed) against the whole tensor in one run."""
    tensor = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    spec = OutputSpec("w", (6, 10), torch.float32)
    parts, whole = ChecksumSink(), ChecksumSink()
    for lo, hi in cuts:
        parts.put_part(spec, block_runs(spec.shape, ShardPiece((0, lo), (6, hi - lo), ())),
                       tensor[:, lo:hi].contiguous())
    whole.put(spec, tensor)
    expected = zlib.crc32(tensor.numpy().tobytes())
    assert _whole_crc(parts.runs["w"], 4) == _whole_crc(whole.runs["w"], 4) == expected
    if len(cuts) > 1:
        assert parts.runs["w"].keys() != whole.runs["w"].keys()  # cut differently: only the combined CRCs compare
    changed = tensor.clone()
    changed[5, 9] = -changed[5, 9]
    other = ChecksumSink()
    other.put(spec, changed)
    assert _whole_crc(other.runs["w"], 4) != expected
