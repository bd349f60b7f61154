"""One merge per target: a lock file beside the target, held from the first check to the final rename.

The lock is a file created with O_CREAT | O_EXCL, which is atomic on local filesystems and on NFS (v3 and
later), Lustre and GPFS, unlike flock, which some shared filesystems ignore or keep per node. It records who
holds it (process_id.py: host, pid, kernel, start time; and the command). A lock is stale when its holder is
provably gone: on the same kernel, no process with that pid and start time exists (a pid alone may have been
reused); from another host, the holder has not refreshed the lock's mtime for STALE_AFTER_S (it does so every
REFRESH_S).
A stale lock is broken under a second, short-lived lock, so two merges that find it stale at once cannot
both take it.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, fields
from pathlib import Path

from ..engine.process_id import ProcessId
from ..errors import TargetBusyError, TargetError

REFRESH_S = 30.0
STALE_AFTER_S = 300.0


def lock_record(token: str) -> dict:
    """What a lock holds: who took it (host, pid, kernel, start time), when, with which command, and a token that
    tells its taker's lock from one taken after it was broken."""
    return {**asdict(ProcessId.of_this_process()),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "token": token}


def holder_running(holder: dict) -> bool | None:
    """Whether the merge that took a lock still runs; None where this process cannot tell (another host or
    kernel, or a record never finished)."""
    try:
        holder_process = ProcessId(*(holder[f.name] for f in fields(ProcessId)))
    except KeyError:
        return None
    return holder_process.alive(ProcessId.of_this_process())


def busy_line(holder: dict, lock: object, target: object) -> str:
    who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
           f"{holder.get('command')}") if holder else "a merge whose lock record is unreadable"
    return f"another merge is writing this target ({who}); wait for it to end, or if it is gone, remove {lock}, {target}"


class TargetLock:
    def __init__(self, path: Path, target: Path):
        self.path, self.target = path, target
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(3):  # a stale lock is broken at most twice before giving up
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise TargetBusyError(self._busy(holder)) from None
                self._break(holder)
                continue
            except OSError as e:
                raise TargetError(f"cannot create the target's lock file ({e.strerror}), {self.path}") from e
            with os.fdopen(fd, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
            self._refresher = threading.Thread(target=self._refresh, name="merger-lock", daemon=True)
            self._refresher.start()
            return
        raise TargetBusyError(f"cannot take the target's lock: it keeps changing hands, {self.path}")

    def live_holder(self) -> dict | None:
        """The record of a merge that holds the lock and is not stale ({} when its record is unreadable), taking
        nothing; None when the lock is free or stale."""
        holder = self._holder()
        return None if holder is None or self._stale(holder) else holder

    def release(self) -> None:
        """Remove the lock if it is still this merge's (never another's that broke it as stale)."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
            self._refresher = None
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _record(self) -> dict:
        return lock_record(self.token)

    def _holder(self) -> dict | None:
        """The record of whoever holds the lock; {} when it is unreadable (being written, or garbage)."""
        try:
            data = json.loads(Path(self.path).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _stale(self, holder: dict) -> bool:
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return True
        running = holder_running(holder)
        if running is not None:
            return not running
        return age > STALE_AFTER_S  # another host (or kernel): only the refresh tells

    def _busy(self, holder: dict) -> str:
        return busy_line(holder, self.path, self.target)

    def _break(self, holder: dict | None) -> None:
        """Remove a stale lock, under a breaker lock so that a fresh lock taken meanwhile is never removed."""
        breaker = Path(f"{self.path}.break")
        try:
            fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(breaker).st_mtime > 60:
                    os.unlink(breaker)  # left by a breaker that died: breaking takes milliseconds
            time.sleep(0.1)
            return
        try:
            os.close(fd)
            if self._holder() == holder:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.unlink(breaker)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)
