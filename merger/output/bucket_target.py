"""A bucket target (s3://, gs://, az://): the merged folder sent by every rank at once as uploads in parts
(io/object_writers.py: S3's multipart uploads, GCS's composed objects, Azure's block blobs), the model's entry
points last.

The merge writes the model into a local staging folder (the staging rules of target.py hold there) and the ranks
send the weight files' parts as their blocks are written (part_stream.py); what was not streamed (small files, files
a resumed merge reused) each rank uploads its share of after the merge, and rank 0 completes the uploads. An object
written by a multipart upload exists only once completed, and `config.json`, the index and the manifest are put
after every weight file is complete, the manifest last: nothing at the target reads as a model before it is one.

One merge per target holds in the bucket too: a lock object created only where none exists (If-None-Match), with
the same record and the same staleness rule as the local lock (target_lock.py). A failure, or Ctrl-C, aborts the
uploads begun; a killed merge leaves only invisible uploads and its lock, which the next merge on this host finds
stale; its uploads are aborted there before anything is written.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import MergerError, TargetBusyError, TargetError
from ..hf_folder import INDEX
from ..io.local import punch_hole
from ..io.object_writers import object_writer
from ..units import format_size
from .manifest import MANIFEST
from .target_lock import busy_line, holder_running, lock_record

log = logging.getLogger("merger")

LOCK = ".merger-lock"
PART = 16 << 20  # bytes per part: S3 takes 5 MiB to 5 GiB each but the last, and at most MAX_PARTS parts
MAX_PARTS = 10_000
UPLOADS_IN_FLIGHT = 4  # parts each rank sends at once: PART bytes of memory each
LAST = ("config.json", INDEX, MANIFEST)  # put in this order after every other file: a model's entry points


@dataclass(frozen=True)
class Part:
    name: str  # the file's path relative to the folder
    number: int  # from 1
    start: int
    size: int
    parts: int  # how many the file has: 1 is a plain put


def part_size(size: int) -> int:
    """PART, or PART times the smallest power of two that keeps the file within MAX_PARTS parts: a power of two
    so that it divides the checksum block (256 MiB) and parts stream block by block (part_stream.py)."""
    step = PART
    while -(-size // step) > MAX_PARTS:
        step *= 2
    return step


def streams(size: int, block: int) -> bool:
    """Whether a file's parts nest in its checksum blocks of `block` bytes, so that each is sent by the rank that
    checksums its block as soon as the block is written; other files (one of over 2.5 TB) are sent after the
    merge."""
    return block % part_size(size) == 0


def parts_of(files: dict[str, int]) -> list[Part]:
    """Every part of every file (name -> size), in file order."""
    parts = []
    for name, size in sorted(files.items()):
        step = part_size(size)
        count = max(1, -(-size // step))
        parts += [Part(name, i + 1, i * step, min(step, size - i * step), count) for i in range(count)]
    return parts


def shares(parts: list[Part], world: int) -> list[list[Part]]:
    """The parts each rank uploads: the largest first to whichever rank has the fewest bytes (ties to the lowest
    rank), so every rank sends about as much and all ranks agree without talking."""
    load, out = [0] * world, [[] for _ in range(world)]
    for part in sorted(parts, key=lambda p: (-p.size, p.name, p.number)):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += part.size
        out[rank].append(part)
    return out


def folder_files(folder: Path) -> dict[str, int]:
    """Every file below `folder` (relative POSIX path -> size)."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


class BucketTarget:
    """Rank 0's side of a bucket target: its checks, its lock, the uploads it begins and completes."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.writer = object_writer(self.url)
        self.token = uuid.uuid4().hex
        self.locked = False
        self.uploads: dict[str, str] = {}  # name -> multipart upload id, begun and not yet completed
        self.earlier: list[str] = []
        self.entry_points: list[str] = []  # the LAST objects this merge put
        # abort() and release() one at a time: the failure path and a peer watch's cleanup may both run them at once
        # (torchrun's SIGTERM and the watch both see a lost rank), and an upload aborted twice fails the second time.
        self.ending = threading.RLock()

    def open(self, overwrite: bool, resume: bool) -> None:
        """Check the prefix and take its lock, before the merge writes anything: an earlier merge there is replaced only
        with --overwrite (or --resume), anything else there is refused."""
        self.writer.check_bucket()
        self._lock()
        for name, upload_id in self.writer.open_uploads():  # a killed merge's: its lock was stale
            log.info("merger: aborting an unfinished upload left at %s/%s", self.url, name)
            self.writer.abort(name, upload_id)
        self.earlier = [n for n in self.writer.names() if n != LOCK]
        if not self.earlier:
            return
        if MANIFEST not in self.earlier:
            raise TargetError(f"target holds objects and no merger output (no {MANIFEST}): merger replaces only an "
                              f"empty prefix or an earlier merge; choose another --target_dir, {self.url}")
        if not (overwrite or resume):
            raise TargetError(f"target holds an earlier merge: pass --overwrite to replace it, {self.url}")
        # From here until the new manifest is put, the target reads as no finished model.
        self.writer.remove([MANIFEST])

    def _lock(self) -> None:
        record = json.dumps(lock_record(self.token)).encode()
        for _ in range(2):  # a stale lock is removed once
            try:
                if self.writer.create(LOCK, record):
                    self.locked = True
                    return
            except MergerError:
                # the create may have reached the store with its answer lost: release() removes the lock if ours
                self.locked = True
                raise
            try:
                holder = json.loads(self.writer.read(LOCK) or b"{}")
            except ValueError:
                holder = {}
            if isinstance(holder, dict) and holder.get("token") == self.token:
                # ours: the create reached the store and its answer was lost, and the client's retry found it
                self.locked = True
                return
            if not isinstance(holder, dict) or holder_running(holder) is not False:
                raise TargetBusyError(busy_line(holder if isinstance(holder, dict) else {}, f"{self.url}/{LOCK}",
                                                self.url))
            log.info("merger: the lock at %s/%s was left by a merge that is gone: taking it", self.url, LOCK)
            self.writer.remove([LOCK])
        raise TargetBusyError(f"cannot take the target's lock: it keeps changing hands, {self.url}/{LOCK}")

    def begin(self, parts: list[Part]) -> dict[str, str]:
        """Begin a multipart upload for each file of several parts; their ids, for every rank."""
        for part in parts:
            if part.parts > 1 and part.name not in self.uploads:
                self.uploads[part.name] = self.writer.begin(part.name)
        return dict(self.uploads)

    def complete(self, parts: list[Part], etags: dict[tuple[str, int], str], folder: Path) -> None:
        """Complete every upload, then put the entry points, the manifest last; remove what an earlier merge left
        that this one did not write."""
        for name, upload_id in sorted(self.uploads.items()):
            count = next(p.parts for p in parts if p.name == name)
            self.writer.complete(name, upload_id, [etags[(name, n)] for n in range(1, count + 1)])
            del self.uploads[name]
        # An upload begun by a create whose answer was lost and that the client sent again: invisible, but stored
        # and paid for until aborted. Under this merge's lock, every upload open at the prefix is this merge's.
        for name, upload_id in self.writer.open_uploads():
            self.writer.abort(name, upload_id)
        written = set(folder_files(folder))
        for name in LAST:
            if name in written:
                self.entry_points.append(name)
                self.writer.put(name, (folder / name).read_bytes())
        self.writer.remove(sorted(set(self.earlier) - written - {MANIFEST}))

    def abort(self) -> None:
        """After a failure: abort the uploads begun (their parts are dropped), remove the entry points put before
        the failure (a config.json without its manifest would read as a model), release the lock."""
        with self.ending:
            for name, upload_id in sorted(self.uploads.items()):
                try:
                    self.writer.abort(name, upload_id)
                except MergerError as e:
                    log.warning("merger: could not abort the upload of %s/%s (%s); the bucket's lifecycle rule for "
                                "incomplete uploads removes it", self.url, name, e)
            self.uploads.clear()
            try:
                self.writer.remove(self.entry_points)
            except MergerError as e:
                log.warning("merger: could not remove %s, put before the merge failed (%s): remove it by hand",
                            ", ".join(f"{self.url}/{n}" for n in self.entry_points), e)
            self.entry_points.clear()
            self.release()

    def release(self) -> None:
        with self.ending:
            if not self.locked:
                return
            self.locked = False
            try:
                holder = json.loads(self.writer.read(LOCK) or b"{}")
                if isinstance(holder, dict) and holder.get("token") == self.token:
                    self.writer.remove([LOCK])
            except (ValueError, MergerError) as e:
                # after a failure, whose line this must not replace: the next merge on this host finds the lock stale
                log.warning("merger: could not release the lock %s/%s (%s)", self.url, LOCK, e)


def give_back(path: Path, start: int, size: int) -> None:
    """Punch a sent part's range out of its staging file: it keeps its size, reads as zeros there and takes no disk.
    A filesystem that cannot is warned of once."""
    global _cannot_punch
    fd = os.open(path, os.O_WRONLY)
    try:
        punched = punch_hole(fd, start, size)
    finally:
        os.close(fd)
    if not punched and not _cannot_punch:
        _cannot_punch = True
        log.warning("merger: this filesystem cannot give back the space of uploaded parts (fallocate "
                    "PUNCH_HOLE): the staging folder grows to the model's size, %s", path.parent)


_cannot_punch = False  # warned once a process


def upload_share(url: str, folder: Path, mine: list[Part], uploads: dict[str, str],
                 release: frozenset[str]) -> dict[tuple[str, int], str]:
    """One rank's parts (LAST files excluded: rank 0 puts those at the end), UPLOADS_IN_FLIGHT at a time: the
    ETag of each multipart part. The parts of the files in `release` are given back once the store has them."""
    writer = object_writer(url)

    def send(part: Part) -> tuple[tuple[str, int], str | None]:
        with open(folder / part.name, "rb") as f:
            data = os.pread(f.fileno(), part.size, part.start)
        if len(data) != part.size:
            raise MergerError(f"the merged file changed while it was uploaded, {folder / part.name}")
        etag = None
        if part.parts == 1:
            writer.put(part.name, data)
        else:
            etag = writer.upload_part(part.name, uploads[part.name], part.number, data)
        if part.name in release:
            give_back(folder / part.name, part.start, part.size)
        return (part.name, part.number), etag

    with ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="merger-upload") as pool:
        return {key: etag for key, etag in pool.map(send, mine) if etag is not None}


def uploaded_line(url: str, files: dict[str, int], seconds: float, world: int) -> str:
    total = sum(files.values())
    return (f"merger: uploaded {len(files)} files ({format_size(total)}) to {url}, {seconds:.1f}s after the merge"
            f"{f' from {world} ranks' if world > 1 else ''}")
