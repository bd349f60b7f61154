"""Resuming an interrupted merge: the manifest that says what a staging folder holds, and what can be reused.

`merge_manifest.json` is written into the staging folder before any tensor byte, and kept up to date: the
source files (sizes, mtimes), the options that shape the output, each output file's size and header digest,
and each output file's sha256 as soon as every rank has written and flushed all of it. `--resume` reuses the
files whose bytes still hash to the recorded value when source, options and layout are unchanged, and
skips the steps whose outputs all live in reused files. The finished model keeps the manifest, complete.

Checksums cost one read of the output on rank 0, done in a background thread while later batches stream;
verifying reused files on resume costs one read of them, shared among the ranks.

Test hook, read only here: with MERGER_TEST_PAUSE_AFTER_BATCH=N and MERGER_TEST_PAUSE_FILE=P, once batches
0..N are written on every rank (and rank 0 has checksummed the files they completed) each rank writes its
pid to `P.<rank>` and sleeps, so tests can kill a real merge at a known point. MERGER_TEST_PAUSE_RANK=r
pauses only rank r: the others go on into the next collective and wait there for it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from . import __version__
from .catalog import Catalog
from .dist import Group
from .errors import MergerError
from .options import MergeOptions
from .output import MANIFEST, FileSink, write_manifest
from .plan import Batch, Plan

log = logging.getLogger("merger")

# Options that change how a merge runs but not one byte of what it writes.
_RUNTIME_OPTIONS = {"local_dir", "target_dir", "max_inflight", "device", "overwrite", "dist_timeout", "debug",
                    "resume", "keep_partial", "log_level"}
_CHUNK = 16 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL on large buffers: streaming goes on meanwhile
    return digest.hexdigest()


def source_fingerprint(catalog: Catalog) -> dict[str, dict[str, int]]:
    """Size and mtime of every source file, keyed by its path inside the checkpoint folder."""
    out = {}
    for f in catalog.files:
        st = os.stat(f)
        out[os.path.relpath(f, catalog.root)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def start_manifest(catalog: Catalog, options: MergeOptions, plan: Plan, world: int) -> dict:
    """What a staging folder is the start of; everything but the `sha256` values is known before streaming."""
    shaping = {k: v for k, v in dataclasses.asdict(options).items() if k not in _RUNTIME_OPTIONS}
    return {
        "merger_version": __version__, "source_format": catalog.format,
        "source_dir": str(Path(catalog.root).absolute()), "source_files": source_fingerprint(catalog),
        "options": json.loads(json.dumps(shaping, default=str)), "dtype": options.dtype, "merge_ranks": world,
        "output_files": {f.name: {"size": f.size, "header_sha256": hashlib.sha256(f.prefix).hexdigest(),
                                  "sha256": None} for f in plan.files},
        "complete": False,
    }


def _mismatch(old: dict, new: dict) -> str | None:
    for key, what in (("merger_version", "merger version"), ("source_files", "source files"),
                      ("options", "options")):
        if old.get(key) != new[key]:
            return f"the {what} changed"
    layout = {n: (f["size"], f["header_sha256"]) for n, f in new["output_files"].items()}
    try:
        before = {n: (f["size"], f["header_sha256"]) for n, f in old["output_files"].items()}
    except (KeyError, TypeError, AttributeError):
        before = None
    return None if before == layout else "the output layout changed"


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
    """Flushes each output file once its last batch is written, then checksums it on rank 0 into the manifest."""

    def __init__(self, plan: Plan, sink: FileSink, group: Group, stage: Path, manifest: dict):
        self.plan, self.sink, self.group, self.stage, self.manifest = plan, sink, group, stage, manifest
        self.last_batch: dict[int, int] = {}
        for bi, batch in enumerate(plan.batches):
            for si in batch.steps:
                for spec in plan.steps[si].outputs:
                    self.last_batch[plan.location[spec.name][0]] = bi
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="merger-sha256") if group.rank == 0 else None
        self.pending = {i for i, f in enumerate(plan.files)
                        if manifest["output_files"][f.name]["sha256"] is None} if self.pool else set()
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        pause, only = os.environ.get("MERGER_TEST_PAUSE_AFTER_BATCH"), os.environ.get("MERGER_TEST_PAUSE_RANK")
        self.pause_at = int(pause) + 1 if pause and (only is None or int(only) == group.rank) else None

    def written(self, index: int) -> None:
        self.sink.sync([i for i, last in self.last_batch.items() if last == index])

    def confirmed(self, count: int) -> None:
        if self.pool is not None:
            for i in sorted(i for i in self.pending if self.last_batch.get(i, -1) < count):
                self.pending.discard(i)
                self.futures.append(self.pool.submit(self._checksum, i))
        if count == self.pause_at:
            self._pause()

    def _checksum(self, index: int) -> None:
        name = self.plan.files[index].name
        digest = sha256_file(self.stage / name)
        with self.lock:
            self.manifest["output_files"][name]["sha256"] = digest
            write_manifest(self.stage, self.manifest)

    def final_manifest(self) -> dict:
        """Rank 0, after the last batch: wait for every checksum; a failed one is a write error."""
        self.pool.shutdown(wait=True)
        for future in self.futures:
            try:
                future.result()
            except OSError as e:  # reading back a file rank 0 did not create: vanished or unreadable
                raise MergerError(f"cannot read back the merged model ({e.strerror}), {e.filename}") from e
        return self.manifest

    def stop(self) -> None:
        """On failure: drop queued checksums and wait for the one running."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _pause(self) -> None:
        if self.pool is not None:
            for future in self.futures:
                future.result()
        Path(f"{os.environ['MERGER_TEST_PAUSE_FILE']}.{self.group.rank}").write_text(str(os.getpid()))
        time.sleep(3600)
