"""Noticing a lost rank within seconds, even while this rank is stuck inside a collective.

A gloo or NCCL collective blocks the main thread in C++, where no Python signal handler or exception can
reach it: a peer that vanished without closing its sockets (a node gone, a network cut) keeps it there for
the whole --dist_timeout, and torchrun's SIGTERM to the survivors of a killed rank is never handled. So each
rank of a group runs a watch thread beside the merge, talking through the store torch.distributed
rendezvoused on (torchrun's agent hosts it; under plain env:// rank 0 does):

- it beats: a counter per rank in the store, every PERIOD_S;
- it judges each peer: one on this kernel and pid namespace is lost as soon as its process is gone (a
  certain answer, found in a second); one elsewhere after STALE_BEATS checks in a row saw no new beat.
  Checks, not seconds, are counted: a stall of this thread or a slow store delays the verdict instead of
  faking one, and a peer must miss ten beats, not one slow write, before it counts as lost (torch ops,
  hashing and file I/O release the GIL, so a rank busy casting or fsyncing still beats). A store that
  stops answering is the loss of the rank that hosts it;
- a rank leaving the group marks its counter `left` first, so its exit is no loss;
- it sees every SIGTERM / SIGINT (signal.set_wakeup_fd): one the main thread cannot act on, because it has
  been waiting in a collective since before it came (its peers handled theirs and left), it acts on itself.

The first rank to find a loss records it in the store, so all ranks name the same lost rank. Every survivor
then ends itself from its watch thread (its main thread may never come back): the lowest surviving rank runs
the cleanup the merge registered (the staging folder: removed, or kept for --keep-partial / --resume) and
prints the one error line, and every survivor exits with status 1.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Callable

from ..errors import show_error_line
from ..io import scratch_folders
from .process_id import ProcessId
from .torchrun_error import record_for_torchrun

PERIOD_S = 1.0
STALE_BEATS = 10
HURRIED_S = 0.1  # between checks while the main thread waits for a verdict (a collective just failed)
_STORE_TIMEOUT_S = 10.0
STORE_HOST_EXIT_S = 2.0  # from a dying rank 0's sockets closing to its process being seen gone
SIGNAL_GRACE_S = 2.0  # a SIGTERM / SIGINT the main thread has not acted on by then, inside a collective, never will
_LEFT = b"left"

log = logging.getLogger("merger")


class Cleanup:
    """Work that must run at most once, from whichever thread asks first: the merge's failure path or a watch
    thread ending the process. `instead` runs something else under the same lock (the rename of the staging
    folder into the target), so the two can never overlap, and makes the cleanup a no-op once it succeeded."""

    def __init__(self, fn: Callable[[], None]):
        self._fn, self._lock, self._pending = fn, threading.Lock(), True

    def __call__(self) -> None:
        with self._lock:
            if self._pending:
                self._fn()
                self._pending = False  # only once done: a cleanup cut short (a second signal) runs again

    def instead(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._pending:
                raise RuntimeError("the cleanup ran already: the process is ending")
            fn()
            self._pending = False


class PeerWatch:
    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it
        self.store_name = f"{addr}:{port}"
        # A connection of its own, with a short timeout: the process group's stays untouched. Keys are per
        # torchrun restart, since the agent's store outlives the workers it restarts.
        client = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=_STORE_TIMEOUT_S))
        self.store = dist.PrefixStore(f"merger-watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client)
        self.me = ProcessId.of_this_process()
        self.store.set(f"who/{rank}", json.dumps(asdict(self.me)))
        self.store.compare_set("lost", "", "")  # exists from now on: read with the beats, never waited for
        for r in range(world):  # every key exists from now on; this rank's first beat tells who it is at once
            self.store.add(f"beat/{r}", int(r == rank))
        self.peers = [r for r in range(world) if r != rank]
        self.who: dict[int, ProcessId] = {}
        self.last: dict[int, bytes] = {}
        self.missed = dict.fromkeys(self.peers, 0)
        self.left: set[int] = set()
        self.dead: set[int] = set()  # this rank's own verdicts, for who reports when ranks disagree
        self.counted_at = self.asked_at = 0.0
        self.cleanup: Callable[[], None] | None = None  # what a loss must clean up here, set by the merge
        self.lock = threading.Lock()  # held by `stop` to end the watch, or for good by `_end`
        self.stopped = False
        # Signals reach this thread too: Python runs its handlers only on the main thread, and only between
        # bytecodes, which a rank waiting inside a collective for a peer that will never come does not reach.
        self.signals, self.restore_fd, self.signalled = None, None, None
        self.collective_since: float | None = None  # set by the group around each collective
        if threading.current_thread() is threading.main_thread():
            self.signals, wakeup = os.pipe()
            for fd in (self.signals, wakeup):
                os.set_blocking(fd, False)
            self.restore_fd = signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
        self.wake, self.hurry, self.settled, self.ending = (threading.Event() for _ in range(4))
        self.thread = threading.Thread(target=self._run, name="merger-peer-watch", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Leave the group: no verdict from now on, and peers see this rank's exit as no loss. Blocks for good
        when a loss is being reported (the watch thread is about to end the process)."""
        with self.lock:
            self.stopped = True
        self.wake.set()
        self.thread.join()
        if self.signals is not None:
            os.close(signal.set_wakeup_fd(self.restore_fd))
            os.close(self.signals)
        try:
            self.store.set(f"beat/{self.rank}", _LEFT)
        except Exception:  # noqa: BLE001 - the store is gone with its host: nobody is left to tell
            pass

    def explain(self, wait_s: float = PERIOD_S * STALE_BEATS + 2) -> None:
        """A collective failed or a signal came: if a peer is lost, the watch ends the process (this never
        returns). Else return once every peer is known alive or gone normally, or after `wait_s` (a peer on
        another host needs its missed beats), and let the caller report its own error."""
        self.settled.clear()
        self.asked_at = time.monotonic()
        self.hurry.set()
        self.wake.set()
        deadline = time.monotonic() + wait_s
        while not self.ending.wait(HURRIED_S):
            if self.settled.is_set() or time.monotonic() > deadline:
                self.hurry.clear()
                return
        while True:  # the watch thread prints the line and exits: nothing else may happen meanwhile
            try:
                with self.lock:
                    pass
            except KeyboardInterrupt:  # torchrun's SIGTERM, say: the ending is under way already
                pass

    def _run(self) -> None:
        try:
            while not self.stopped:
                # Quickly until every peer is known by its process: one lost before that could only be named by the
                # store it took along (rank 0's), and a merge can be well under way within its first second.
                unknown = any(r not in self.who and r not in self.left for r in self.peers)
                woken = self.wake.wait(HURRIED_S if self.hurry.is_set() or unknown else PERIOD_S)
                self.wake.clear()
                if self.stopped:
                    return
                if woken:  # asked at once (a collective failed): a peer whose sockets just closed may still be
                    time.sleep(HURRIED_S)  # exiting; let it be gone before it is judged and its store used
                found = self._check()
                if found is not None:
                    self._end(*found)
                    return
                self._unheard_signal()
        except Exception as e:  # noqa: BLE001 - a bug here must not take the merge down; the timeout still holds
            log.warning("merger: rank %d stopped watching its peers: %s: %s", self.rank, type(e).__name__, e)

    def _check(self) -> tuple[int | None, str] | None:
        """One look at the peers: (lost rank, or None for torchrun's agent; the message) or None if all is well."""
        started = time.monotonic()
        found = self._dead_process()
        if found is not None:
            return self._record(*found)
        try:
            self.store.add(f"beat/{self.rank}", 1)
            values = self.store.multi_get([f"beat/{r}" for r in self.peers] + ["lost"])
            for r, value in zip(self.peers, values):  # a peer says who it is before its first beat
                if r not in self.who and value not in (b"0", _LEFT):
                    self.who[r] = ProcessId(**json.loads(self.store.get(f"who/{r}")))
        except Exception as e:  # noqa: BLE001 - any store failure means its host is gone or cut off
            found = None if self.agent_store else self._host_died()  # rank 0 may have just died: say that
            return self._record(*found) if found is not None else self._store_lost(e)
        if values[-1]:
            record = json.loads(values[-1])
            return record["rank"], record["message"]
        now = time.monotonic()
        count = now - self.counted_at >= PERIOD_S * 0.9  # one miss per beat period, however often we look
        if count:
            self.counted_at = now
        for r, value in zip(self.peers, values):
            if value == _LEFT:
                self.left.add(r)
                continue
            if count:
                self.missed[r] = self.missed[r] + 1 if value == self.last.get(r) else 0
                self.last[r] = value
            if self.missed[r] >= STALE_BEATS:
                host = self.who[r].host if r in self.who else "its host"
                return self._record(r, f"rank {r} was lost: no heartbeat from it on {host} for "
                                       f"{self.missed[r]} beats of {PERIOD_S:g} s")
        if self.hurry.is_set() and started > self.asked_at and all(
                r in self.left or r in self.who and self.who[r].alive(self.me) for r in self.peers):
            self.settled.set()  # nothing to wait for: every peer runs on this host, or left the group
        return None

    def _dead_process(self) -> tuple[int, str] | None:
        for r in self.peers:
            if r in self.who and r not in self.left and self.who[r].alive(self.me) is False:
                return r, f"rank {r} was lost: its process (pid {self.who[r].pid} on {self.who[r].host}) ended"
        return None

    def _host_died(self) -> tuple[int, str] | None:
        """Rank 0 hosts the store: if it runs on this kernel, wait up to STORE_HOST_EXIT_S for its process to be
        seen gone. A dying process closes its sockets before it becomes a zombie, so the store can fail while
        /proc still shows it running; the verdict names the process ending, not the store it took along."""
        deadline = time.monotonic() + STORE_HOST_EXIT_S
        while True:
            found = self._dead_process()
            if found is not None or 0 not in self.who or self.who[0].alive(self.me) is None or \
                    time.monotonic() > deadline:
                return found
            time.sleep(HURRIED_S / 10)

    def _store_lost(self, e: Exception) -> tuple[int | None, str]:
        why = f"the rendezvous store it hosts, {self.store_name}, stopped answering ({str(e).splitlines()[0]})"
        return (None, f"rank {self.rank} lost torchrun's agent: {why}") if self.agent_store else \
            (0, f"rank 0 was lost: {why}")

    def _record(self, rank: int, message: str) -> tuple[int | None, str]:
        """Publish this verdict unless a peer published one first; either way, the first one is the one told."""
        self.dead.add(rank)
        try:
            first = self.store.compare_set("lost", "", json.dumps({"rank": rank, "message": message}))
        except Exception as e:  # noqa: BLE001 - no store: under torchrun its agent is gone, the root cause (the
            # peer may have ended for that very reason); else every survivor judges alone and sees the same death
            return self._store_lost(e) if self.agent_store else (rank, message)
        if first:
            record = json.loads(first)
            return record["rank"], record["message"]
        return rank, message

    def _unheard_signal(self) -> None:
        """A SIGTERM or SIGINT (scancel, torchrun stopping its workers) while the main thread waits in a
        collective for peers that handled theirs and left: end this rank as its handler would have."""
        try:
            received = os.read(self.signals, 512) if self.signals is not None else b""
        except BlockingIOError:
            received = b""
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum in received and self.signalled is None:
                self.signalled = (signum, time.monotonic())
        since = self.collective_since
        if self.signalled is not None and since is not None and since < self.signalled[1] and \
                time.monotonic() - self.signalled[1] > SIGNAL_GRACE_S:
            where = f" (rank {self.rank})"
            self._end(None, f"interrupted by {signal.Signals(self.signalled[0]).name}{where}", every_rank=True,
                      status=130)

    def _end(self, lost: int | None, message: str, every_rank: bool = False, status: int = 1) -> None:
        """End the process: the lowest surviving rank runs the cleanup; it prints the line, or every rank does
        (`every_rank`: its own interruption, or torchrun's agent lost, which may have taken rank 0 along)."""
        self.lock.acquire()  # never released: this thread ends the process
        if self.stopped:
            self.lock.release()
            return
        self.ending.set()
        gone = self.dead | self.left | ({lost} if lost is not None else set())
        every_rank = every_rank or lost is None
        cleaner = min(r for r in range(self.world) if r not in gone or r == self.rank)
        reporter = self.rank if every_rank else cleaner
        try:
            if self.cleanup is not None and self.rank == cleaner:
                self.cleanup()
        except Exception as e:  # noqa: BLE001 - the line below must still be printed
            log.warning("merger: cleanup after the lost rank failed: %s: %s", type(e).__name__, e)
        finally:
            line = f"merger: error: {message}{'' if every_rank else '; every other rank stopped'}"
            if self.rank == reporter:
                show_error_line(line)
            record_for_torchrun(line)  # every rank that ends here: torchrun's report names the loss
            sys.stdout.flush()
            scratch_folders.remove_all()  # their atexit handler never runs
            os._exit(status)
