"""Resuming an interrupted merge: the manifest that says what a staging folder holds, and what can be reused.

`merge_manifest.json` is written into the staging folder before any tensor byte, and kept up to date: the
resolved source folder and each source file's identity (size, mtime, ctime, inode), the options that shape the
output (MergeOptions marks them; a family file with its content's CRC-32), each output file's size and the CRC-32 of its header, and each output
file's checksums: the CRC-32 of each block of `checksum_block_bytes` (CHECKSUM_BLOCK) bytes, the last one
shorter, each recorded once every rank has written and flushed all of its bytes. `--resume` reuses the files
whose every block still checks against the recorded value when source, options and layout are unchanged, and
skips the steps whose outputs all live in reused files. The finished model keeps the manifest, complete.

CRC-32, not a cryptographic digest: the checksums guard against torn and partial writes (a killed rank, a full
disk, a block never flushed), not against someone forging bytes, and ISA-L's CRC-32 (sources/crc32.py) runs at 11 GB/s
a core where sha256 ran at 1.8. A manifest whose `checksum_algorithm` is not CHECKSUM (an older merger's
sha256 blocks) describes nothing a resume reuses.

Checksums are dealt among the ranks block by block (each rank takes about 1/M of the bytes, however many files
there are, so a one-file model is not left to one rank). Each rank takes the CRC of the bytes it writes as it
writes them (FileSink.write_crcs) and sends them to the block's rank at the next sync point, which combines
them (CrcSpans): the output is not read again. Only a block that holds bytes no CRC was taken of (copied inside
the kernel, or in runs too short to be worth one) is read back, in a background thread while later batches
stream. Verifying reused files on resume costs one read of them, shared among the ranks the same way.
"""
from __future__ import annotations

import dataclasses
import errno
import heapq
import json
import logging
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Hashable, TypeVar

import numpy as np

from ..version import __version__
from ..catalog import Catalog
from ..engine.dist import Group
from ..engine.plan import Batch, OutputFile, Plan
from ..errors import TargetError
from ..options import MergeOptions
from ..sources.crc32 import CrcSpans, crc32
from .files import FileSink
from .manifest import Manifest, OutputEntry, read_manifest, write_manifest
from .safetensors_layout import file_layout
from .source_identity import source_folder
from .written_crcs import WrittenCrcs

log = logging.getLogger("merger")

_CHUNK = 16 << 20
CHECKSUM = "crc32"  # the manifest's `checksum_algorithm`: what its header and block checksums are
# Bytes per output checksum. Each block is checked on its own, by whichever rank it is dealt to, so the hashing
# spreads over the ranks whatever the number of files; large enough that a manifest of a 1 TB model lists 4000.
CHECKSUM_BLOCK = 256 << 20

K = TypeVar("K", bound=Hashable)


def block_span(size: int, block: int, k: int) -> tuple[int, int]:
    """[start, end) of checksum block k of a file of `size` bytes: [k block, (k + 1) block), the last one shorter."""
    return k * block, min((k + 1) * block, size)


def block_spans(size: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each checksum block of a file of `size` bytes: [0, block), [block, 2 block), ..."""
    return [block_span(size, block, k) for k in range(-(-size // block))]


def deal_blocks(sizes: list[tuple[K, int]], block: int, world: int) -> list[list[tuple[K, int]]]:
    """The checksum blocks of the files `sizes` lists ((file, size), in an order every rank shares), dealt to
    `world` ranks: per rank, its (file, block number) pairs. In order, each block goes to the rank with the
    fewest bytes so far (the lowest such rank): round-robin while blocks are full, and no rank collects the
    short last blocks of a run of files: no rank ends more than one block's bytes ahead of another."""
    shares: list[list[tuple[K, int]]] = [[] for _ in range(world)]
    load = [(0, rank) for rank in range(world)]  # a heap: (bytes dealt, rank)
    for key, size in sizes:
        for k, (start, end) in enumerate(block_spans(size, block)):
            dealt, rank = load[0]
            shares[rank].append((key, k))
            heapq.heapreplace(load, (dealt + end - start, rank))
    return shares


def block_outputs(f: OutputFile, block: int) -> list[list[str]]:
    """Per checksum block of `f`: the outputs whose bytes lie in it. The header needs none: it is written
    before streaming starts."""
    layout = file_layout(f)
    blocks: list[list[str]] = [[] for _ in block_spans(layout.size, block)]
    base = layout.data_start
    for e in f.entries:
        if e.end > e.begin:
            for k in range((base + e.begin) // block, (base + e.end - 1) // block + 1):
                blocks[k].append(e.name)
    return blocks


def crc32_hex(crc: int) -> str:
    """A CRC-32 as the manifest records it: 8 lowercase hex digits, as `format(zlib.crc32(data), "08x")`."""
    return f"{crc:08x}"


def crc32_range(path: Path, start: int, end: int, buf: memoryview | None = None) -> str:
    """The CRC-32 of bytes [start, end) of `path`, read through `buf` (16 MiB when not given)."""
    crc = 0
    buf = buf if buf is not None else memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while start < end:
            got = f.readinto(buf[:min(len(buf), end - start)])
            if not got:
                raise OSError(errno.EIO, f"file ended at byte {start} of {end}", str(path))
            crc = crc32(buf[:got], crc)  # ctypes releases the GIL during the call: streaming goes on meanwhile
            start += got
    return crc32_hex(crc)


def _blocks_match(path: Path, size: int, block: int, want: list[str], buf: memoryview) -> bool:
    """Whether `path` is `size` bytes long and each block has `want`'s checksum (OSError if unreadable)."""
    spans = block_spans(size, block)
    return (path.stat().st_size == size and len(want) == len(spans)
            and all(crc32_range(path, start, end, buf) == crc for (start, end), crc in zip(spans, want)))


def _shaping(options: MergeOptions) -> dict:
    """The options that shape the output as the manifest records them; a family file by its path and the CRC-32 of
    its content: a row fixed in the file (gate and up swapped back) maps anew under the same path, into files whose
    names, shapes and headers are the old ones, which their checksums alone would let a resume keep."""
    shaping = json.loads(json.dumps(options.output_shaping(), default=str))
    if options.family is not None:
        shaping["family"] = {"file": str(options.family),
                             "crc32": crc32_hex(zlib.crc32(Path(options.family).read_bytes()))}
    return shaping


def start_manifest(catalog: Catalog, sources: dict[str, dict[str, int]], options: MergeOptions, plan: Plan,
                   world: int) -> Manifest:
    """What a staging folder is the start of; everything but the block checksums is known before streaming.
    `sources` is the source files' identity, taken when the checkpoint was opened (source_identity.py)."""
    layouts = {f.name: file_layout(f) for f in plan.files}
    return Manifest(
        merger_version=__version__, source_format=catalog.format,
        source_dir=source_folder(catalog), source_files=sources,
        options=_shaping(options), dtype=options.dtype,
        merge_ranks=world, checksum_algorithm=CHECKSUM, checksum_block_bytes=CHECKSUM_BLOCK,
        output_files={name: OutputEntry(size=layout.size, header_crc32=crc32_hex(zlib.crc32(layout.header)),
                                        crc32_blocks=[None] * len(block_spans(layout.size, CHECKSUM_BLOCK)))
                      for name, layout in layouts.items()},
        complete=False,
    )


def _mismatch(old: Manifest, new: Manifest) -> str | None:
    for key, what in (("merger_version", "merger version"), ("source_dir", "source folder"),
                      ("source_format", "source format"), ("source_files", "source files"),
                      ("options", "options that shape the output")):
        if getattr(old, key) != getattr(new, key):
            return f"the {what} changed"
    if old.checksum_algorithm != new.checksum_algorithm:  # nothing in it can be checked: as good as no manifest
        kind = old.checksum_algorithm or "sha256 (an older merger's)"
        return f"its checksums are {kind}, not {new.checksum_algorithm}"
    # Blocks of another size make every recorded checksum incomparable: as good as another layout.
    layout = {n: (f.size, f.header_crc32) for n, f in new.output_files.items()}
    before = None if old.output_files is None else {n: (f.size, f.header_crc32) for n, f in old.output_files.items()}
    same = before == layout and old.checksum_block_bytes == new.checksum_block_bytes
    return None if same else "the output layout changed"


def _finished(blocks: object) -> bool:
    """Whether a manifest's `crc32_blocks` has every block's checksum."""
    return isinstance(blocks, list) and all(isinstance(digest, str) for digest in blocks)


def why_not_done(folder: Path, manifest: Manifest) -> str | None:
    """Rank 0, `--resume` on a target holding a finished merge: None when it is this very merge (same source,
    options, version and layout) with every file's bytes intact, else the reason it is not."""
    try:
        old = read_manifest(folder)
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    if old.complete is not True:
        return "it is not a complete merge"
    reason = _mismatch(old, manifest)
    if reason:
        return reason
    buf = memoryview(bytearray(_CHUNK))
    for name, info in manifest.output_files.items():
        want = old.output_files[name].crc32_blocks
        try:
            if not (_finished(want)
                    and _blocks_match(folder / name, info.size, manifest.checksum_block_bytes, want, buf)):
                return f"{name} no longer matches its checksums"
        except OSError:
            return f"{name} cannot be read"
    return None


def resume_candidates(stage: Path, manifest: Manifest) -> dict[str, list[str]]:
    """Rank 0: files of `stage` that a resumed merge may keep if their bytes still check out: name -> the
    CRC-32 of each block.

    Empty when the old manifest is missing or describes another merge (logged with the reason).
    """
    try:
        old = read_manifest(stage)
    except FileNotFoundError:
        log.info("merger: --resume: no partial merge at %s, starting from scratch", stage)
        return {}
    except (OSError, ValueError) as e:  # ValueError: no JSON, or no JSON object
        reason = f"it cannot be read ({e})"
    else:
        reason = _mismatch(old, manifest)
    if reason:
        log.info("merger: --resume: not reusing %s: %s", stage, reason)
        return {}
    candidates = {}
    for name, info in manifest.output_files.items():
        want, file = old.output_files[name].crc32_blocks, stage / name
        if (_finished(want) and len(want) == len(info.crc32_blocks) and file.is_file()
                and file.stat().st_size == info.size):
            candidates[name] = want
    return candidates


def verify_share(stage: Path, manifest: Manifest, candidates: dict[str, list[str]], rank: int,
                 world: int) -> list[tuple[str, int]]:
    """This rank's share of the candidates' blocks (dealt as the checksums were), checked: the (file, block)
    pairs whose bytes match."""
    block, files = manifest.checksum_block_bytes, manifest.output_files
    buf = memoryview(bytearray(_CHUNK))
    good = []
    for name, k in deal_blocks([(name, files[name].size) for name in sorted(candidates)], block, world)[rank]:
        try:
            if crc32_range(stage / name, *block_span(files[name].size, block, k), buf) == candidates[name][k]:
                good.append((name, k))
        except OSError:
            pass  # vanished or unreadable: written again
    return good


def intact_files(candidates: dict[str, list[str]],
                 shares: list[list[tuple[str, int]]]) -> dict[str, list[str]]:
    """The candidates every block of which some rank's verify_share found intact: name -> block checksums."""
    good = {pair for share in shares for pair in share}
    return {name: blocks for name, blocks in candidates.items()
            if all((name, k) in good for k in range(len(blocks)))}


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
            batches.append(Batch(steps, b.routes.where(~np.isin(b.routes.step, list(done))), out))
    return dataclasses.replace(plan, batches=batches)


class FileTracker:
    """Flushes each output file once its last batch is written, and checksums the output, every rank its share.

    The checksum blocks of the files still to write are dealt over the ranks (deal_blocks: about 1/M of the
    bytes each, even for a one-file model); rank r hashes its blocks in a background thread while later
    batches stream, so little hashing is left at the end. A block is hashed once every output with bytes in it
    is known to be written: by this rank itself (its writes handed to the sink), or by every rank (a batch
    confirmed at a sync point). Before the hashing thread records a block's CRC, reads it back or sends its
    parts, it waits for this rank's writes handed over until then to be in the file (FileSink.wait_written): a
    direct write returns to the writer before its bytes are written (direct_writes.py), and a CRC recorded
    before its bytes would make a merge killed in between leave a manifest that its own files contradict, which
    --resume then reuses nothing of. On one host the page cache shows each rank's writes at once; across hosts (a
    shared filesystem promises only close-to-open consistency) other ranks' outputs count only after the
    file's last batch, when its writers have flushed and closed it. Checksums reach rank 0, which keeps the
    manifest, at the next sync point. For an s3:// target the same read of a block sends its upload parts
    (part_stream.py), and each sync point waits for the sender to keep up.
    """

    def __init__(self, plan: Plan, sink: FileSink, group: Group, stage: Path, manifest: Manifest, one_host: bool,
                 sender=None):
        self.plan, self.sink, self.group, self.stage, self.manifest = plan, sink, group, stage, manifest
        # An s3:// target's part_stream.PartSender: a block of a file it streams is read once, for its checksum
        # and its upload parts, then released. Its ETags reach rank 0 with the checksums.
        self.sender = sender
        self.etags: dict[tuple[str, int], str] = {}  # rank 0: every part's ETag received
        self.sending: list[Future] = []  # blocks handed to the sender, their reads not yet done
        self.block = manifest.checksum_block_bytes
        written_in: dict[str, int] = {}
        for bi, batch in enumerate(plan.batches):
            for si in batch.steps:
                for spec in plan.steps[si].outputs:
                    written_in[spec.name] = bi
        self.last_batch: dict[int, int] = {}
        for name, bi in written_in.items():
            index = plan.location[name][0]
            self.last_batch[index] = max(self.last_batch.get(index, -1), bi)
        pending = [(i, file_layout(f).size) for i, f in enumerate(plan.files) if i not in sink.skip]
        shares = deal_blocks(pending, self.block, group.world)
        mine = shares[group.rank]
        # The CRCs of the bytes every rank writes (FileSink.write_crcs), of blocks of files the sender does not
        # read anyway: those of this rank's blocks gathered here, by block; those of other ranks' blocks held
        # for their rank until the next sync point.
        self.owner = {block: rank for rank, share in enumerate(shares) for block in share}
        self.spans: dict[tuple[int, int], CrcSpans] = {}
        self.outgoing: list[list[tuple[int, int, int, int]]] = [[] for _ in range(group.world)]
        crc_files = frozenset(i for i, _ in pending if sender is None or plan.files[i].name not in sender.files)
        self.crcs = sink.write_crcs(crc_files, self.block)
        headers = WrittenCrcs(crc_files, self.block)  # written by rank 0 before streaming; every rank has them
        for i in crc_files:
            headers.add(i, memoryview(bytearray(file_layout(plan.files[i]).header)), 0)
        self._add_crcs([r for r in headers.take() if self.owner[(r[0], r[1] // self.block)] == group.rank])
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="merger-crc32") if mine else None
        # This rank's units not yet handed to the hashing thread -> the outputs in them not known written yet;
        # each such output -> those units; and the batch after which every rank has written it -> the outputs.
        # A unit is (file, block, None): a whole block; or, in a file the sender streams, (file, block, part): each
        # upload part of the block, handed on its own as soon as it is written, so that a part is sent and
        # released without waiting for the rest of its block.
        self.waiting: dict[tuple[int, int, int | None], set[str]] = {}
        self.blocks_of: dict[str, list[tuple[int, int, int | None]]] = {}
        self.confirmed_by: dict[int, set[str]] = {}
        for i, k in mine:
            for unit, names in self._units(i, k):
                self.waiting[unit] = set(names)
                for name in names:
                    self.blocks_of.setdefault(name, []).append(unit)
                    self.confirmed_by.setdefault(written_in[name] if one_host else self.last_batch[i],
                                                 set()).add(name)
        self.confirmed_count = 0
        self.buffer = memoryview(bytearray(_CHUNK)) if mine else None  # the hashing thread's, reused
        self.futures: list[Future] = []
        self.outbox: dict[tuple[str, int], str] = {}  # block checksums finished here, not yet sent to rank 0
        self.lock = threading.Lock()  # the outbox and the manifest, written by the hashing thread
        self.handing = threading.Lock()  # `waiting`: steps are written on stream.py's writer thread
        with self.handing:
            self._hand_over([b for b, left in self.waiting.items() if not left])  # header only: written already

    def _units(self, i: int, k: int) -> list[tuple[tuple[int, int, int | None], list[str]]]:
        """Block k of file i as the units handed to the hashing thread, each with the outputs whose bytes lie in it."""
        f = self.plan.files[i]
        if self.sender is None or f.name not in self.sender.files:
            return [((i, k, None), block_outputs(f, self.block)[k])]
        size = file_layout(f).size
        step = self.sender.step(size)  # divides the block: block k holds whole parts
        start, end = block_span(size, self.block, k)
        outputs = block_outputs(f, step)
        return [((i, k, j), outputs[j]) for j in range(start // step, -(-end // step))]

    def _add_crcs(self, crcs: list[tuple[int, int, int, int]]) -> None:
        """(file, start, end, CRC) of written stretches, each inside one block: this rank's blocks' into
        `spans`, the others' into `outgoing`."""
        for i, start, end, crc in crcs:
            block = (i, start // self.block)
            rank = self.owner[block]
            if rank == self.group.rank:
                spans = self.spans.get(block)
                if spans is None:
                    spans = self.spans[block] = CrcSpans()
                spans.add(start, end, crc)
            else:
                self.outgoing[rank].append((i, start, end, crc))

    def _take_crcs(self) -> None:
        """The CRCs of what the sink wrote since last time: called on the writer thread, or between batches."""
        self._add_crcs(self.crcs.take())

    def step_written(self, step: int) -> None:
        """On the writer thread, after each step: hand over what this rank's own write completed; with a sender,
        wait for it there too, so that a batch larger than the parts in flight does not pile up on disk."""
        if self.pool is not None:
            with self.handing:
                self._take_crcs()
                self._written(spec.name for spec in self.plan.steps[step].outputs)
                sending = self.sending
            if self.sender is not None:
                self._catch_up(sending)

    def written(self, index: int) -> None:
        """On the writer thread, after batch `index`, whose direct writes the stream has waited for (so they are
        done before the sync point that confirms it, where the rank of a block read back may be another one): the
        files it completed synced."""
        self.sink.sync([i for i, last in self.last_batch.items() if last == index])
        self.sink.start_writeback()

    def confirmed(self, count: int) -> None:
        """Every rank, at each sync point: bring finished checksums to rank 0 and the CRCs of written runs to
        their blocks' ranks (a collective of a few bytes per block and run), then hand over what became
        hashable."""
        with self.handing:
            self._take_crcs()
        if self.group.distributed:
            self._exchange()
        if self.pool is not None:
            with self.handing:
                for batch in range(self.confirmed_count, count):
                    self._written(self.confirmed_by.pop(batch, ()))
                self.confirmed_count = count
                sending = self.sending
            if self.sender is not None:
                self._catch_up(sending)

    def _written(self, names) -> None:
        """These outputs' bytes are known to be on disk: hand over the units they completed (`handing` held)."""
        ready = []
        for name in names:
            for b in self.blocks_of.pop(name, ()):
                left = self.waiting[b]
                left.discard(name)
                if not left:
                    ready.append(b)
        self._hand_over(ready)

    def _hand_over(self, units: list[tuple[int, int, int | None]]) -> None:
        mark = self.sink.written_mark()  # this rank's writes of the units' outputs are all handed over by now
        for unit in units:
            del self.waiting[unit]
            self.futures.append(self.pool.submit(self._hash, *unit, mark))
            if unit[2] is not None:
                self.sending.append(self.futures[-1])

    def _catch_up(self, sending: list[Future]) -> None:
        """Wait until at most one part handed to the sender is not yet taken: the merge writes no faster than its
        parts are sent, and the staging folder holds what is being written and the parts in flight
        (part_stream.py), not the model."""
        pending = [future for future in sending if not future.done()]
        wait(pending[:-1])
        with self.handing:
            self.sending = [future for future in self.sending if not future.done()]

    def _hash(self, index: int, k: int, part: int | None, mark: int) -> None:
        f = self.plan.files[index]
        size = file_layout(f).size
        # The unit's bytes, written here by the time it was handed over, in the file before its CRC is recorded or
        # it is read: not every write handed over so far, which a writer that keeps handing them over could delay.
        self.sink.wait_written(mark)
        if part is None:
            start, end = block_span(size, self.block, k)
            spans = self.spans.pop((index, k), None)
            crc = spans.covered(start, end) if spans is not None else None
            if crc is not None:
                digest = crc32_hex(crc)
            else:  # read back
                digest = crc32_range(self.stage / f.name, start, end, self.buffer)
        else:
            digest = self.sender.part_written(self.stage / f.name, f.name, size, block_span(size, self.block, k),
                                              part)
            if digest is None:  # the block has parts still to come
                return
        with self.lock:
            if self.group.rank == 0:
                self._record({(f.name, k): digest})
            else:
                self.outbox[(f.name, k)] = digest

    def _record(self, checksums: dict[tuple[str, int], str]) -> None:
        """Rank 0 (`lock` held): the block checksums into the manifest, and the manifest to disk for --resume
        when a file got its last one (a file with blocks missing is not reused: no need to write sooner)."""
        files = self.manifest.output_files
        for (name, k), digest in checksums.items():
            files[name].crc32_blocks[k] = digest
        if any(_finished(files[name].crc32_blocks) for name in {name for name, _ in checksums}):
            write_manifest(self.stage, self.manifest)

    def _exchange(self) -> None:
        """The collective of each sync point: checksums and ETags to rank 0, CRCs of written runs to their
        blocks' ranks."""
        with self.lock:
            outbox, self.outbox = self.outbox, {}
        etags = self.sender.take() if self.sender is not None else {}
        outgoing, self.outgoing = self.outgoing, [[] for _ in range(self.group.world)]
        shares = self.group.all_gather((outbox, etags, outgoing))
        with self.handing:
            self._add_crcs([crc for _, _, sent in shares for crc in sent[self.group.rank]])
        if self.group.rank == 0:
            with self.lock:
                self._record({block: digest for share, _, _ in shares for block, digest in share.items()})
            for _, sent, _ in shares:
                self.etags.update(sent)

    def wait(self) -> None:
        """Every rank, after the last batch: finish this rank's checksums (and uploads); a failed one is a write
        error."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for future in self.futures:
            try:
                future.result()
            except OSError as e:  # reading back a file this rank did not create: vanished or unreadable
                raise TargetError(f"cannot read back the merged model ({e.strerror}), {e.filename}") from e
        if self.sender is not None:
            self.sender.wait()

    def final_manifest(self) -> Manifest:
        """Every rank, once `wait` has returned everywhere: the last checksums reach rank 0, whose manifest
        then has every block's."""
        if self.group.distributed:
            self._exchange()
        elif self.sender is not None:
            self.etags.update(self.sender.take())
        return self.manifest

    def stop(self) -> None:
        """On failure: drop queued checksums and wait for the one running."""
        if self.sender is not None:
            self.sender.stop()  # first: a checksum thread may be waiting for an upload slot
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
