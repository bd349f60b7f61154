"""A bucket target's weight files uploaded while the merge runs: each upload part, once written, read once for both
its block's checksum and its upload, and its disk space given back once the store has it.

The rank that checksums a block (resume.FileTracker deals the blocks) sends the upload parts that lie in it: the
part size divides the block size (bucket_target.part_size), so no part spans two blocks and the parts of the
file split among the ranks like its checksums. The tracker hands over each part as soon as every rank has
written it; the parts of a block are read in order (its CRC-32 runs front to back), checked as read, then sent by one of
UPLOADS_IN_FLIGHT threads; once the store has them, their range of the staging file is punched out (sparse: it
reads as zeros and takes no disk). So the staging folder holds the parts being written and being sent, not the
model. A resumed merge finds punched blocks failing their checksums and writes them again.
"""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.dist import Group, on_every_rank
from ..io.object_writers import object_writer
from ..sources.crc32 import crc32
from .bucket_target import UPLOADS_IN_FLIGHT, BucketTarget, give_back, part_size, parts_of, streams
from .resume import crc32_hex


class PartSender:
    """One rank's uploads of the parts in its checksum blocks; the ETags of the parts it sent, for rank 0."""

    def __init__(self, url: str, files: set[str], uploads: dict[str, str], release: bool):
        self.writer = object_writer(url)
        self.files = files  # the files streamed: the others are checksummed only, and sent after the merge
        self.uploads = uploads  # name -> multipart upload id (files of one part are put whole)
        self.release = release  # False (--verify): the staging files stay whole for the check that reads them
        self.pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="merger-upload")
        self.slots = threading.Semaphore(UPLOADS_IN_FLIGHT)  # parts read and not yet sent: PART bytes of memory each
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.etags: dict[tuple[str, int], str] = {}  # sent here, not yet taken for rank 0
        self.failed: Exception | None = None  # the first upload that failed: nothing more is sent
        # Per block begun here ((name, start) -> ...): its CRC-32 so far and its parts written but not yet read
        # (a part waits for those before it: the CRC runs in order), and the next part to read.
        self.crcs: dict[tuple[str, int], int] = {}
        self.blocks: dict[tuple[str, int], set[int]] = {}
        self.next: dict[tuple[str, int], int] = {}

    @staticmethod
    def step(size: int) -> int:
        """The part size of a file of `size` bytes: it divides the checksum block (bucket_target.part_size)."""
        return part_size(size)

    def part_written(self, path: Path, name: str, size: int, block: tuple[int, int], part: int) -> str | None:
        """Part `part` (from 0) of the staging file `path` (output `name`, `size` bytes), in checksum block `block`
        ([start, end)), is written. The block's parts are read in order, each hashed and queued for upload as
        soon as it and those before it are written; once the last is, the block's CRC-32, else None. Runs on the
        checksum thread."""
        step = part_size(size)
        start, end = block
        key = (name, start)
        ready = self.blocks.setdefault(key, set())
        ready.add(part)
        crc = self.crcs.get(key, 0)
        number = self.next.get(key, start // step)
        if number in ready:
            with open(path, "rb", buffering=0) as f:
                while number in ready:
                    if self.failed is not None:
                        raise self.failed
                    ready.discard(number)
                    pos = number * step
                    self.slots.acquire()  # before the read: at most UPLOADS_IN_FLIGHT parts in memory
                    data = bytearray(min(step, end - pos))
                    got = os.preadv(f.fileno(), [data], pos)
                    if got != len(data):
                        self.slots.release()
                        raise OSError(errno.EIO, f"file ended at byte {pos + got} of {end}", str(path))
                    crc = crc32(data, crc)
                    self.futures.append(self.pool.submit(self._send, path, name, number + 1, pos, data))
                    number += 1
        self.next[key], self.crcs[key] = number, crc
        if number * step < end:
            return None
        del self.blocks[key], self.next[key], self.crcs[key]
        return crc32_hex(crc)

    def _send(self, path: Path, name: str, number: int, pos: int, data: bytes) -> None:
        try:
            if name in self.uploads:
                etag = self.writer.upload_part(name, self.uploads[name], number, data)
                with self.lock:
                    self.etags[(name, number)] = etag
            else:  # a file of one part: a plain put
                self.writer.put(name, data)
            if self.release:
                give_back(path, pos, len(data))
        except Exception as e:
            self.failed = self.failed or e
            raise
        finally:
            self.slots.release()

    def take(self) -> dict[tuple[str, int], str]:
        """The ETags of the parts sent since the last call."""
        with self.lock:
            etags, self.etags = self.etags, {}
        return etags

    def wait(self) -> None:
        """Every part queued sent; a failed upload is an error of the merge."""
        self.pool.shutdown(wait=True)
        for future in self.futures:
            future.result()  # MergerError: the store's one line (object_upload.py)

    def stop(self) -> None:
        """On failure: drop the queued parts and wait for the ones being sent."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        for _ in range(UPLOADS_IN_FLIGHT):  # a checksum thread blocked on a slot goes on, into the closed pool
            self.slots.release()


@dataclass
class StreamedUpload:
    """An s3:// target's files streamed during the merge: begun by rank 0 before the first batch, their parts sent
    by every rank (PartSender), completed by rank 0 after the merge (object_store_target.py)."""
    url: str
    bucket: BucketTarget | None  # rank 0's; None on the others
    release: bool
    files: dict[str, int] = field(default_factory=dict)  # name -> size of each file streamed
    weights: frozenset[str] = frozenset()  # every weight file, streamed or not (reused by --resume, too large)
    etags: dict[tuple[str, int], str] = field(default_factory=dict)  # rank 0, after the merge: every part's

    def room(self, files: dict[str, int], block: int, max_inflight: int, world: int) -> int:
        """The most disk the staging folder needs at once for `files` (name -> size), checksum blocks of `block`
        bytes: each rank's batch of `max_inflight` and its parts in flight, since a part's space is given back once
        the store has it (docs/object_storage.md), plus whole the files sent after the merge; never more than all
        the files. Without release (--verify) the files stay whole."""
        total = sum(files.values())
        if not self.release:
            return total
        later = sum(size for size in files.values() if not streams(size, block))
        step = max(map(part_size, files.values()), default=part_size(0))
        return min(total, later + world * (max_inflight + UPLOADS_IN_FLIGHT * step))

    def begin(self, group: Group, files: dict[str, int], reused: frozenset[str], block: int,
              debug: bool) -> PartSender:
        """Every rank, before streaming: rank 0 begins the uploads of the weight files (name -> size) to be written,
        not `reused`, whose parts nest in checksum blocks of `block` bytes; each rank's sender of its share of
        their parts."""
        self.weights = frozenset(files)

        def start():
            streamed = {name: size for name, size in files.items() if name not in reused and streams(size, block)}
            return streamed, self.bucket.begin(parts_of(streamed))

        self.files, uploads = group.all_gather(on_every_rank(group, start if group.rank == 0 else (lambda: None),
                                                             debug))[0]
        return PartSender(self.url, set(self.files), uploads, self.release)
