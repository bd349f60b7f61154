"""--device cuda on a node started with more ranks than it shows GPUs: each rank without a GPU of its own stops
with one line that says how many ranks the node takes, before NCCL is asked (engine/dist.py _own_gpu); and
NCCL's own failure to start is one line too.

torch's answers about the device stand in for a one-GPU node (the lent H200 machine is one, where two ranks on its
GPU failed in NCCL's init with "invalid usage", reported as an internal error); no group is started.
"""
import pytest
import torch

from merger.engine.dist import init_group
from merger.errors import MergerError

pytestmark = pytest.mark.unit


@pytest.fixture
def one_gpu_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no store to wait for: the check comes first
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_the_second_rank_of_a_one_gpu_node_is_told_to_start_one(one_gpu_node, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(MergerError, match=r"^--device cuda: rank 1 of 2 is local rank 1 of its node, where it sees "
                                          r"1 CUDA device: .* at most 1 rank per node \(torchrun --nproc_per_node 1\)"
                                          r", or merge over gloo with --device cpu$"):
        init_group("cuda")


def test_a_rank_on_a_second_node_counts_its_own_node(one_gpu_node, monkeypatch):
    """Rank 1 of 2 on a node of its own is local rank 0: it passes the check and goes on to set its device."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen = []

    def set_device(index):
        seen.append(index)
        raise RuntimeError("stop before NCCL")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(RuntimeError, match="stop before NCCL"):
        init_group("cuda")
    assert seen == [0]


def test_an_nccl_init_failure_is_one_line_naming_the_gpu_and_the_likely_cause(one_gpu_node, monkeypatch):
    """NCCL's own error, as it came from two ranks on the lent machine's one GPU, becomes a MergerError (one
    `merger: error:` line on each rank), not an internal error."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    seen = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
            "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid "
            "usage of NCCL library.\nLast error:\n")

    def init_process_group(*args, **kwargs):
        raise dist.DistBackendError(seen)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(MergerError, match=r"^--device cuda: NCCL did not start on cuda:0 \(rank 0 of 2\): NCCL "
                                          r"error in: .*invalid usage .*NCCL version 2\.28\.9\. Two ranks on one "
                                          r"GPU is one cause") as caught:
        init_group("cuda")
    assert "\n" not in str(caught.value)
