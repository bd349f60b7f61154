"""An s3:// target's weight files uploaded while the merge runs: each checksum block, once written, read once for
both its checksum and its upload parts, and its disk space given back once they are uploaded.

The rank that checksums a block (resume.FileTracker deals the blocks) sends the upload parts that lie in it: the
part size divides the block size (bucket_target.part_size), so no part spans two blocks and the parts of the
file split among the ranks like its checksums. A part's bytes are hashed as read, then sent by one of
UPLOADS_IN_FLIGHT threads; once the store has them, their range of the staging file is punched out (sparse:
it reads as zeros and takes no disk). So the staging folder holds the blocks being written and the parts being
sent, not the model. A resumed merge finds punched blocks failing their checksums and writes them again.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.dist import Group, on_every_rank

from ..io.local import punch_hole
from ..io.object_upload import ObjectWriter
from .bucket_target import UPLOADS_IN_FLIGHT, BucketTarget, part_size, parts_of, streams

log = logging.getLogger("merger")


class PartSender:
    """One rank's uploads of the parts in its checksum blocks; the ETags of the parts it sent, for rank 0."""

    def __init__(self, url: str, files: set[str], uploads: dict[str, str], release: bool):
        self.writer = ObjectWriter(url)
        self.files = files  # the files streamed: the others are checksummed only, and sent after the merge
        self.uploads = uploads  # name -> multipart upload id (files of one part are put whole)
        self.release = release  # False (--verify): the staging files stay whole for the check that reads them
        self.pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="merger-upload")
        self.slots = threading.Semaphore(UPLOADS_IN_FLIGHT)  # parts read and not yet sent: PART bytes of memory each
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.etags: dict[tuple[str, int], str] = {}  # sent here, not yet taken for rank 0
        self.cannot_punch = False
        self.failed: Exception | None = None  # the first upload that failed: nothing more is sent

    def send_block(self, path: Path, name: str, size: int, start: int, end: int) -> str:
        """Read bytes [start, end) of the staging file `path` (output `name`, `size` bytes) part by part, queue
        each part's upload, and return the block's sha256. Runs on the checksum thread."""
        step = part_size(size)
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            for pos in range(start, end, step):
                if self.failed is not None:
                    raise self.failed
                data = os.pread(f.fileno(), min(step, end - pos), pos)
                if len(data) != min(step, end - pos):
                    raise OSError(errno.EIO, f"file ended at byte {pos + len(data)} of {end}", str(path))
                digest.update(data)
                self.slots.acquire()
                self.futures.append(self.pool.submit(self._send, path, name, pos // step + 1, pos, data))
        return digest.hexdigest()

    def _send(self, path: Path, name: str, number: int, pos: int, data: bytes) -> None:
        try:
            if name in self.uploads:
                etag = self.writer.upload_part(name, self.uploads[name], number, data)
                with self.lock:
                    self.etags[(name, number)] = etag
            else:  # a file of one part: a plain put
                self.writer.put(name, data)
            if self.release:
                self._punch(path, pos, len(data))
        except Exception as e:
            self.failed = self.failed or e
            raise
        finally:
            self.slots.release()

    def _punch(self, path: Path, pos: int, length: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            punched = punch_hole(fd, pos, length)
        finally:
            os.close(fd)
        if not punched and not self.cannot_punch:
            self.cannot_punch = True
            log.warning("merger: this filesystem cannot give back the space of uploaded parts (fallocate "
                        "PUNCH_HOLE): the staging folder grows to the model's size, %s", path.parent)

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
    by every rank (PartSender), completed by rank 0 after the merge (bucket_merge.py)."""
    url: str
    bucket: BucketTarget | None  # rank 0's; None on the others
    release: bool
    files: dict[str, int] = field(default_factory=dict)  # name -> size of each file streamed
    etags: dict[tuple[str, int], str] = field(default_factory=dict)  # rank 0, after the merge: every part's

    def begin(self, group: Group, files: dict[str, int], block: int, debug: bool) -> PartSender:
        """Every rank, before streaming: rank 0 begins the uploads of the files (name -> size) whose parts nest
        in checksum blocks of `block` bytes; each rank's sender of its share of their parts."""
        def start():
            streamed = {name: size for name, size in files.items() if streams(size, block)}
            return streamed, self.bucket.begin(parts_of(streamed))

        self.files, uploads = group.all_gather(on_every_rank(group, start if group.rank == 0 else (lambda: None),
                                                             debug))[0]
        return PartSender(self.url, set(self.files), uploads, self.release)
