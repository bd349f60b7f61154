"""The parallel plumbing: one process, or a torch.distributed group started by torchrun, Slurm or the launcher.

Data (piece bytes) moves with one all_to_all_single per batch, over NCCL when CUDA is there and gloo
otherwise. Control (did every rank succeed?) always goes over a gloo group on the CPU, so a failing rank
is noticed at the next sync point and every rank stops within the collective timeout instead of hanging.
A rank that dies (killed, out of memory, its node gone) is noticed within seconds by every rank's peer
watch (peer_watch.py), which ends the survivors even while they are stuck in a collective.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from ..errors import Failure, MergerError, failure_of
from .peer_watch import Cleanup, PeerWatch


@contextlib.contextmanager
def _collective(rank: int, watch: PeerWatch | None):
    """A peer that crashed, was killed or stopped answering makes gloo/NCCL raise: say so in one line, naming
    the lost rank when the peer watch finds one (it then ends the process itself)."""
    if watch is not None:
        watch.collective_since = time.monotonic()  # a signal arriving now may never reach the main thread
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's connection errors are RuntimeErrors
        if watch is not None:
            watch.collective_since = None
            watch.explain()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MergerError(f"rank {rank}: lost contact with the other ranks: one crashed, was killed or timed "
                          f"out ({first})") from e
    finally:
        if watch is not None:
            watch.collective_since = None


@dataclass
class Group:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    control: object = None  # gloo process group for status and small objects; None when world == 1
    watch: PeerWatch | None = None  # None when world == 1
    # The group pieces travel in: None for the default group merger started itself; a caller's group otherwise,
    # which close() leaves as it was found (and destroys only the control group merger made beside it).
    borrowed: object = None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def exchange(self, send: torch.Tensor, send_split: list[int], recv: torch.Tensor,
                 recv_split: list[int]) -> torch.Tensor:
        """All-to-all of bytes: `send` holds the block for each rank in rank order (`send_split`); `recv`
        (CPU) is filled with the blocks from each rank in rank order (`recv_split`) and returned."""
        import torch.distributed as dist

        on_device = recv if recv.device == self.device else torch.empty(recv.numel(), dtype=torch.uint8,
                                                                        device=self.device)
        with _collective(self.rank, self.watch):
            dist.all_to_all_single(on_device, send.to(self.device), recv_split, send_split, group=self.borrowed)
        if on_device is not recv:
            recv.copy_(on_device)
        return recv

    def agree(self, error: Failure | None) -> None:
        """Sync point: raise on every rank if any rank failed, naming the first failing rank and its error, as
        an error of that error's kind."""
        if not self.distributed:
            if error:
                raise error.error()
            return
        for rank, failure in enumerate(self.all_gather(error)):
            if failure:
                # The same line and kind on every rank, naming the rank that failed; only rank 0 prints it.
                raise Failure(f"rank {rank}: {failure.line}", failure.kind).error(agreed=True)

    def all_gather(self, value: object) -> list:
        """Every rank's value, in rank order, on every rank (small picklable objects, over the control group)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        values: list = [None] * self.world
        with _collective(self.rank, self.watch):
            dist.all_gather_object(values, value, group=self.control)
        return values

    @cached_property
    def hosts(self) -> list[str]:
        """Each rank's host name, in rank order: a collective the first time (every rank asks at the same step), then
        kept, as a rank's host does not change."""
        return self.all_gather(socket.gethostname())

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            with _collective(self.rank, self.watch):
                dist.barrier(group=self.control)

    def clean_up_on_loss(self, cleanup: Cleanup) -> None:
        """From now until the group closes, a lost rank makes the lowest surviving rank run `cleanup` before
        the group ends (it may have run already: a Cleanup runs once)."""
        if self.watch is not None:
            self.watch.cleanup = cleanup

    def explain_interrupt(self) -> None:
        """A SIGTERM under torchrun usually means its agent saw a rank die: if so, report that loss instead
        (this ends the process). Waits briefly: a death on this host is certain at once."""
        if self.watch is not None:
            self.watch.explain(wait_s=2.0)

    def close(self) -> None:
        """Leave the group together: a rank tearing gloo down while a peer still talks to it can abort the peer."""
        if self.distributed:
            import torch.distributed as dist

            if self.watch is not None:
                self.watch.stop()  # first: from here on this rank's exit is no loss to its peers
            with contextlib.suppress(Exception):  # peers already gone (a failed merge): nothing left to wait for
                dist.barrier(group=self.control)
            if self.borrowed is None:
                dist.destroy_process_group()
            elif self.control is not self.borrowed:
                dist.destroy_process_group(self.control)
            # gloo's worker threads free the last collectives' tensors after those return, which takes the GIL.
            # Kept alive by this reference until interpreter finalization, they would do it mid-teardown and
            # abort the process ("terminate called without an active exception"); the last reference
            # dropped here joins them now, with the GIL released.
            self.control = None


# Between tries to reach rank 0's store while it is not listening yet (await_store).
STORE_POLL_S = 0.01


def await_store(addr: str, port: int, timeout_s: float) -> None:
    """Return once something listens at `addr`:`port` (rank 0's TCPStore), trying every STORE_POLL_S, or after
    `timeout_s` or an error other than a refused connection: torch's own client then says what is wrong.

    The ranks of `launcher local` and of srun start together, and rank 0 starts the store only once torch is
    imported. torch's client, finding no listener, backs off before it tries again: on this project's 2-core
    machine a rank that got there first joined 0.3-0.7 s after rank 0's store was up, in about half the 2-rank
    merges. A connection opened and closed is nothing to the store."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            probe = socket.create_connection((addr, port), timeout=1.0)  # a host that drops it: torch's to wait on
            if probe.getsockname() != probe.getpeername():
                probe.close()
                return
            # TCP's self-connect: a connection to a free port of this host's own ephemeral range may be given that
            # port as its own end, and then holds the port rank 0's store is about to listen on (it fails with
            # EADDRINUSE). Polled every 10 ms, the kernel's walk through the ports reaches it within seconds.
            # Closed with a reset, the port is free at once.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            probe.close()
            raise ConnectionRefusedError
        except ConnectionRefusedError:
            if time.monotonic() + STORE_POLL_S > deadline:
                return
            time.sleep(STORE_POLL_S)
        except OSError:  # an unknown host, an unreachable network, a timeout: torch's error names it
            return


def init_group(device: str = "auto", timeout_s: float = 600) -> Group:
    """Join the group torchrun/Slurm described in the environment, or run alone when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Group()
    import torch.distributed as dist

    # Before the group exists: torch.distributed.nn.functional, which comes with torch.distributed.checkpoint
    # (merger reads DCP without it; code sharing the process may not), has `group=group.WORLD` default
    # arguments. Evaluated with the group up, they would hold it past destroy_process_group into interpreter
    # finalization (see Group.close).
    import torch.distributed.nn.functional  # noqa: F401

    rank = int(os.environ.get("RANK", "0"))
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if rank != 0 and addr and port and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # else torchrun's
        await_store(addr, int(port), timeout_s)  # agent hosts the store, up before any rank starts
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise MergerError("--device cuda asked for, but CUDA is not available on this machine")
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        local = _own_gpu(rank, world)
        torch.cuda.set_device(local)
        try:
            with _store_port_taken(rank, addr, port):
                dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        except dist.DistBackendError as e:  # eager init (device_id): NCCL's checks fail here, on every rank
            raise MergerError(f"--device cuda: NCCL did not start on cuda:{local} (rank {rank} of {world}): "
                              f"{str(e).splitlines()[0]}. Two ranks on one GPU is one cause (NCCL takes one rank per "
                              "GPU: see LOCAL_RANK and CUDA_VISIBLE_DEVICES); NCCL_DEBUG=WARN says more") from e
        control = dist.new_group(backend="gloo", timeout=timeout)
        return Group(rank, world, torch.device("cuda", local), control, PeerWatch(rank, world))
    with _store_port_taken(rank, addr, port):
        dist.init_process_group("gloo", timeout=timeout)
    return Group(rank, world, torch.device("cpu"), dist.group.WORLD, PeerWatch(rank, world))


@contextlib.contextmanager
def _store_port_taken(rank: int, addr: str | None, port: str | None):
    """Rank 0 hosts the store under plain env:// (launcher local, Slurm): a MASTER_PORT that another process holds is
    one line saying so, not torch's DistNetworkError with a C++ trace."""
    import torch.distributed as dist

    try:
        yield
    except dist.DistNetworkError as e:
        if rank != 0 or "EADDRINUSE" not in str(e):
            raise
        raise MergerError(f"rank 0 cannot host the group's store on port {port} of {addr}: another process holds "
                          f"that port (MASTER_PORT); start the ranks again with a free one") from e


def _own_gpu(rank: int, world: int) -> int:
    """The GPU of this rank: its LOCAL_RANK, which must name one this process sees. A node started with more
    ranks than GPUs fails here, with what to do, rather than in set_device ("invalid device ordinal")."""
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise MergerError(f"--device cuda: rank {rank} of {world} is local rank {local} of its node, where it sees "
                          f"{count} CUDA device{'s' if count != 1 else ''}: NCCL needs a GPU of its own for each rank, "
                          f"so start at most {count} rank{'s' if count != 1 else ''} per node (torchrun "
                          f"--nproc_per_node {count}), or merge over gloo with --device cpu")
    return local


def borrow_group(process_group=None) -> Group:
    """A Group over the caller's torch.distributed group (`process_group`, else the default one a training script
    started), used as it is and left so: no peer watch (what a lost rank means is the caller's job's to decide)
    and, over NCCL, a gloo group of merger's own for control, made here with every rank of the default group
    (torch's rule for new_group) and destroyed by close()."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world <= 1:
        return Group()
    if dist.get_backend(group) == "gloo":
        return Group(rank, world, torch.device("cpu"), group, borrowed=group)
    control = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
    return Group(rank, world, torch.device("cuda", torch.cuda.current_device()), control, borrowed=group)


def on_every_rank(group: Group, fn: Callable[[], object], debug: bool = False):
    """Run fn here, then sync: if it failed on any rank, raise the same MergerError on all of them."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the error must reach the sync point
        error = failure_of(e, group.rank, debug)
    group.agree(error)
    return result


def on_rank_zero(group: Group, fn: Callable[[], object], debug: bool = False):
    """Run fn on rank 0, then sync as on_every_rank; fn's result on rank 0, None on the others."""
    return on_every_rank(group, fn if group.rank == 0 else (lambda: None), debug)
