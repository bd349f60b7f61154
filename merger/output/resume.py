"""Resuming an interrupted merge: the manifest that says what a staging folder holds, and what can be reused.

`merge_manifest.json` is written into the staging folder before any tensor byte, and kept up to date: the
resolved source folder and each source file's identity (size, mtime, ctime, inode), the options that shape the
output (MergeOptions marks them), each output file's size and header digest,
and each output file's sha256 as soon as every rank has written and flushed all of it. `--resume` reuses the
files whose bytes still hash to the recorded value when source, options and layout are unchanged, and
skips the steps whose outputs all live in reused files. The finished model keeps the manifest, complete.

Checksums cost one read of the output, shared among the ranks (each hashes every M-th file) and done in a
background thread while later batches stream; verifying reused files on resume costs one read of them, shared
among the ranks the same way.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import __version__
from ..catalog import Catalog
from ..engine.dist import Group
from ..engine.plan import Batch, Plan
from ..errors import MergerError
from ..options import MergeOptions
from .files import MANIFEST, FileSink, write_manifest
from .source_identity import source_folder

log = logging.getLogger("merger")

_CHUNK = 16 << 20


def hash_range(digest, path: Path, start: int, end: int, buf: memoryview | None = None) -> None:
    """Feed bytes [start, end) of `path` to `digest` through `buf` (16 MiB when not given)."""
    buf = buf if buf is not None else memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while start < end:
            got = f.readinto(buf[:min(len(buf), end - start)])
            if not got:
                raise OSError(errno.EIO, f"file ended at byte {start} of {end}", str(path))
            digest.update(buf[:got])  # hashlib releases the GIL on large buffers: streaming goes on meanwhile
            start += got


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    hash_range(digest, path, 0, os.path.getsize(path))
    return digest.hexdigest()


def start_manifest(catalog: Catalog, sources: dict[str, dict[str, int]], options: MergeOptions, plan: Plan,
                   world: int) -> dict:
    """What a staging folder is the start of; everything but the `sha256` values is known before streaming.
    `sources` is the source files' identity, taken when the checkpoint was opened (source_identity.py)."""
    return {
        "merger_version": __version__, "source_format": catalog.format,
        "source_dir": source_folder(catalog), "source_files": sources,
        "options": json.loads(json.dumps(options.output_shaping(), default=str)), "dtype": options.dtype,
        "merge_ranks": world,
        "output_files": {f.name: {"size": f.size, "header_sha256": hashlib.sha256(f.prefix).hexdigest(),
                                  "sha256": None} for f in plan.files},
        "complete": False,
    }


def _mismatch(old: dict, new: dict) -> str | None:
    for key, what in (("merger_version", "merger version"), ("source_dir", "source folder"),
                      ("source_format", "source format"), ("source_files", "source files"),
                      ("options", "options that shape the output")):
        if old.get(key) != new[key]:
            return f"the {what} changed"
    layout = {n: (f["size"], f["header_sha256"]) for n, f in new["output_files"].items()}
    try:
        before = {n: (f["size"], f["header_sha256"]) for n, f in old["output_files"].items()}
    except (KeyError, TypeError, AttributeError):
        before = None
    return None if before == layout else "the output layout changed"


def why_not_done(folder: Path, manifest: dict) -> str | None:
    """Rank 0, `--resume` on a target holding a finished merge: None when it is this very merge (same source,
    options, version and layout) with every file's bytes intact, else the reason it is not."""
    try:
        old = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    if not isinstance(old, dict) or old.get("complete") is not True:
        return "it is not a complete merge"
    reason = _mismatch(old, manifest)
    if reason:
        return reason
    for name, info in manifest["output_files"].items():
        try:
            if sha256_file(folder / name) != old["output_files"][name].get("sha256"):
                return f"{name} no longer matches its checksum"
        except OSError:
            return f"{name} cannot be read"
    return None


def resume_candidates(stage: Path, manifest: dict) -> dict[str, str]:
    """Rank 0: files of `stage` that a resumed merge may keep if their bytes still hash right: name -> sha256.

    None when the old manifest is missing or describes another merge (logged with the reason).
    """
    path = stage / MANIFEST
    if not path.is_file():
        log.info("merger: --resume: no partial merge at %s, starting from scratch", stage)
        return {}
    try:
        old = json.loads(path.read_text())
        reason = _mismatch(old, manifest) if isinstance(old, dict) else "it is not a JSON object"
    except (OSError, ValueError) as e:
        reason = f"it cannot be read ({e})"
    if reason:
        log.info("merger: --resume: not reusing %s: %s", stage, reason)
        return {}
    candidates = {}
    for name, info in manifest["output_files"].items():
        want, file = old["output_files"][name].get("sha256"), stage / name
        if isinstance(want, str) and file.is_file() and file.stat().st_size == info["size"]:
            candidates[name] = want
    return candidates


def verify_share(stage: Path, candidates: dict[str, str], rank: int, world: int) -> list[str]:
    """This rank's share of the candidates (every world-th file), hashed: the names whose bytes match."""
    good = []
    for name in sorted(candidates)[rank::world]:
        try:
            if sha256_file(stage / name) == candidates[name]:
                good.append(name)
        except OSError:
            pass  # vanished or unreadable: written again
    return good


def skip_finished(plan: Plan, reused: set[str]) -> Plan:
    """The plan minus the steps whose outputs all live in reused files (empty batches dropped)."""
    if not reused:
        return plan
    done_files = {i for i, f in enumerate(plan.files) if f.name in reused}
    done = {si for si, step in enumerate(plan.steps)
            if all(plan.location[o.name][0] in done_files for o in step.outputs)}
    batches = []
    for b in plan.batches:
        steps = tuple(s for s in b.steps if s not in done)
        if steps:
            out = sum(o.nbytes for s in steps for o in plan.steps[s].outputs
                      if plan.location[o.name][0] not in done_files)
            batches.append(Batch(steps, tuple(r for r in b.routes if r.step not in done), out))
    return dataclasses.replace(plan, batches=batches)


class FileTracker:
    """Flushes each output file once its last batch is written, and checksums the output, every rank its share.

    Rank r hashes the files of its share (every world-th file still to write, so no one rank reads back the
    whole model) front to back in a background thread while later batches stream, so little hashing is left
    at the end. A stretch of a file is hashed once it and all before it are known to be written: by this rank
    itself (as soon as its write returns), or by every rank (a batch confirmed at a sync point). On one host
    the page cache shows each rank's writes at once; across hosts (a shared filesystem promises only
    close-to-open consistency) other ranks' stretches count only after the file's last batch, when its writers
    have flushed and closed it. Checksums reach rank 0, which keeps the manifest, at the next sync point.
    """

    def __init__(self, plan: Plan, sink: FileSink, group: Group, stage: Path, manifest: dict, one_host: bool):
        self.plan, self.sink, self.group, self.stage, self.manifest = plan, sink, group, stage, manifest
        written_in: dict[str, int] = {}
        for bi, batch in enumerate(plan.batches):
            for si in batch.steps:
                for spec in plan.steps[si].outputs:
                    written_in[spec.name] = bi
        self.last_batch: dict[int, int] = {}
        for name, bi in written_in.items():
            index = plan.location[name][0]
            self.last_batch[index] = max(self.last_batch.get(index, -1), bi)
        pending = [i for i in range(len(plan.files)) if i not in sink.skip]
        mine = pending[group.rank::group.world]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="merger-sha256") if mine else None
        # Per file of this rank's share, in file order: (end of a stretch, the output written there, the batch
        # after which every rank has written it). The header is written before streaming starts.
        self.stretches: dict[int, list[tuple[int, str | None, int]]] = {}
        for i in mine:
            f = self.plan.files[i]
            self.stretches[i] = [(len(f.prefix), None, -1)] + [
                (len(f.prefix) + e.end, e.name, written_in[e.name] if one_host else self.last_batch[i])
                for e in f.entries]
        self.confirmed_count = 0
        self.own: set[str] = set()  # outputs this rank has written itself
        self.hashed = {i: 0 for i in mine}  # bytes handed to the hashing thread so far
        self.cursor = {i: 0 for i in mine}  # stretches handed over so far
        self.digests = {i: hashlib.sha256() for i in mine}
        self.buffer = memoryview(bytearray(_CHUNK)) if mine else None  # the hashing thread's, reused
        self.futures: list[Future] = []
        self.outbox: dict[str, str] = {}  # checksums finished here and not yet sent to rank 0
        self.lock = threading.Lock()  # the outbox and the manifest, written by the hashing thread
        self.handing = threading.Lock()  # the cursors: steps are written on stream.py's writer thread

    def step_written(self, step: int) -> None:
        if self.pool is not None:
            with self.handing:
                self.own.update(spec.name for spec in self.plan.steps[step].outputs)
                self._hand_over()

    def written(self, index: int) -> None:
        self.sink.sync([i for i, last in self.last_batch.items() if last == index])
        self.sink.start_writeback()

    def confirmed(self, count: int) -> None:
        """Every rank, at each sync point: hand over what became hashable, and bring finished checksums to
        rank 0 (a collective of a few bytes)."""
        if self.pool is not None:
            with self.handing:
                self.confirmed_count = count
                self._hand_over()
        if self.group.distributed:
            self._send_checksums()

    def _hand_over(self) -> None:
        """Give the hashing thread every file's newly complete stretch, front to back (`handing` held)."""
        for i, stretches in self.stretches.items():
            k = self.cursor[i]
            while k < len(stretches) and (stretches[k][2] < self.confirmed_count or stretches[k][1] in self.own):
                k += 1
            if k == self.cursor[i]:
                continue
            start, end = self.hashed[i], stretches[k - 1][0]
            self.cursor[i], self.hashed[i] = k, end
            self.futures.append(self.pool.submit(self._hash, i, start, end, k == len(stretches)))

    def _hash(self, index: int, start: int, end: int, last: bool) -> None:
        name = self.plan.files[index].name
        hash_range(self.digests[index], self.stage / name, start, end, self.buffer)
        if last:
            with self.lock:
                if self.group.rank == 0:
                    self._record({name: self.digests[index].hexdigest()})
                else:
                    self.outbox[name] = self.digests[index].hexdigest()

    def _record(self, checksums: dict[str, str]) -> None:
        """Rank 0 (`lock` held): the checksums into the manifest, and the manifest to disk for --resume."""
        if checksums:
            for name, sha256 in checksums.items():
                self.manifest["output_files"][name]["sha256"] = sha256
            write_manifest(self.stage, self.manifest)

    def _send_checksums(self) -> None:
        with self.lock:
            outbox, self.outbox = self.outbox, {}
        shares = self.group.all_gather(outbox)
        if self.group.rank == 0:
            with self.lock:
                self._record({name: sha256 for share in shares for name, sha256 in share.items()})

    def wait(self) -> None:
        """Every rank, after the last batch: finish this rank's checksums; a failed one is a write error."""
        if self.pool is None:
            return
        self.pool.shutdown(wait=True)
        for future in self.futures:
            try:
                future.result()
            except OSError as e:  # reading back a file this rank did not create: vanished or unreadable
                raise MergerError(f"cannot read back the merged model ({e.strerror}), {e.filename}") from e

    def final_manifest(self) -> dict:
        """Every rank, once `wait` has returned everywhere: the last checksums reach rank 0, whose manifest
        then has every file's."""
        if self.group.distributed:
            self._send_checksums()
        return self.manifest

    def stop(self) -> None:
        """On failure: drop queued checksums and wait for the one running."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
