"""How every test writer run under torchrun ends: all ranks done, the process group destroyed, the process gone.

`dist.destroy_process_group()` does not stop gloo's threads in a writer that shards with `fully_shard`: the
DTensors' DeviceMesh stays referenced from torch's sharding-propagation caches, so the ProcessGroupGloo object
lives on, and its two worker threads and its TCP loop thread are still running after destroy + gc.collect().
They were then torn down during interpreter finalization, and a rank now and then died there with SIGABRT
("terminate called without an active exception": a C++ thread ended or destroyed mid-shutdown) after writing
every file, so torchrun reported the writer as failed. Leaving with os._exit once the group is destroyed skips
finalization: every file a writer writes is closed by then, and only the output streams need flushing, and the
processes the libraries started need ending (megatron-core's multiprocessing Manager servers, which the skipped
atexit handler would have stopped: left running, they hold the test's output pipe open until its timeout).
"""
from __future__ import annotations

import multiprocessing
import os
import sys

import torch.distributed as dist


def leave_group() -> None:
    """Wait for every rank, destroy the group, flush the output streams and exit 0 without finalization."""
    dist.barrier()  # no rank leaves while a peer may still send to it
    dist.destroy_process_group()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
