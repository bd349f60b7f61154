"""The target folder: staged beside it, written at planned offsets by every rank, renamed into place at the end.

Until the final rename nothing at the target looks like a model: the work happens in a hidden staging
folder `.<target>.merger-partial` next to it, so the rename is atomic on the same filesystem.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import threading
from pathlib import Path

import torch

from ..engine.memory import start_writeback
from ..engine.plan import Plan, Runs
from ..errors import MergerError, SourceError, TargetError
from ..hf_folder import INDEX, files_to_copy
from ..io.local import preallocate
from ..mapping.steps import OutputSpec
from ..sources.file_reads import Placed, source_shrank
from ..units import format_size
from .direct_writes import ALIGN, DirectWrites
from .manifest import MANIFEST, Manifest, write_manifest
from .safetensors_layout import file_layout
from .written_crcs import WrittenCrcs
from .write_turns import copy_at, write_at


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a merge that cannot fit: cheaper than failing with ENOSPC after minutes of streaming."""
    try:
        st = os.statvfs(folder)
    except OSError as e:
        raise TargetError(f"cannot check free space ({e.strerror}), {folder}") from e
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise TargetError(f"not enough free space for the merged model: it needs {format_size(needed)}, "
                          f"{format_size(free)} are free, {folder}")


def prepare_files(stage: Path, plan: Plan, keep: frozenset[str] = frozenset(), allocate: bool = False,
                  room: int | None = None) -> None:
    """Create every output file at its final size with its header in place (rank 0, before streaming).

    Files named in `keep` are finished files a resumed merge reuses: they are left exactly as they are.
    Growing each file to its final size up front also meets a file size limit (EFBIG) before any streaming.
    With `allocate`, each file's disk blocks are reserved too (fallocate, where the filesystem has it): a direct
    write (direct_writes.py) into a hole allocates its blocks under the inode's lock held exclusively, so that the
    ranks' writes into one file, and a rank's buffered edges beside them, go one at a time; into allocated blocks
    it holds the lock shared (ext4). Two O_DIRECT writers of 1 GiB each into one file took 1.28-1.31 s with the
    blocks reserved against 1.50 s without, here.
    `room`: the free space the merge needs there, where it is less than the files' (a bucket target's stage, which
    gives each part's space back once it is sent); None: the files not kept.
    """
    if stage.exists() and not keep:
        shutil.rmtree(stage)
    stage.mkdir(parents=True, exist_ok=True)
    for f in plan.files:  # a resumed merge's unfinished files: written anew, so their space counts as free
        if f.name not in keep:
            (stage / f.name).unlink(missing_ok=True)
    made = [(f.name, file_layout(f)) for f in plan.files if f.name not in keep]
    check_free_space(stage, sum(layout.size for _, layout in made) if room is None else room)
    for name, layout in made:
        path = stage / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # side files may sit in a subfolder
            with open(path, "wb") as out:
                out.write(layout.header)
                out.truncate(layout.size)
                if allocate:
                    preallocate(out.fileno(), layout.size)
        except OSError as e:
            raise TargetError(f"cannot write the merged model ({e.strerror}), {path}") from e


# Bytes per pwrite. Linux sizes the page-cache folios a write creates by its length; folios of 512 KiB and up
# must come from contiguous free memory, and filling new ones ran at 0.6-1.0 GB/s on this project's VM against
# 4-5 GB/s for writes of 128-256 KiB (2.2 GB into a new file; cp, which splices page by page, gets the latter).
WRITE_CHUNK = 256 << 10
# Bytes per copy_file_range. The kernel copies from the source's page cache to the output's without this process
# touching them; 4.13 GiB of DCP chunks into one file took 3.3-4.8 s of system CPU in 64 MiB calls, 4.7-5.9 s in
# 256 KiB ones, and 5.5-9.3 s as pread + pwrite of 256 KiB (benchmarks: docs/benchmarks.md).
COPY_CHUNK = 64 << 20
# What copy_file_range fails with where the kernel or the filesystem cannot copy between these two files
# (another filesystem on an older kernel, a filesystem without the call): the bytes then go through memory.
_CANNOT_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class FileSink:
    """Writes each output tensor's bytes at its planned offset; several ranks write one file side by side.

    With `direct`, the aligned middle of each piece that lies aligned in a batch buffer (put_lasting) goes past the
    page cache, and with `bounce` that of every other piece too (direct_writes.py)."""

    def __init__(self, stage: Path, plan: Plan, skip: frozenset[str] = frozenset(), take_turns: bool = False,
                 direct: bool = False, bounce: bool = True):
        self.stage, self.plan = stage, plan
        self.take_turns = take_turns  # with the other ranks of this host (write_turns.py)
        self.direct = DirectWrites(direct, bounce)
        self.crcs: WrittenCrcs | None = None  # of the bytes written from memory, once write_crcs asks for them
        self.fds: dict[int, int] = {}
        # Pieces are copied on stream.py's main thread while its writer thread writes: both open files.
        self.opening = threading.Lock()
        # Files a resumed merge reuses: their bytes are already right, so outputs landing there are dropped.
        self.skip = {i for i, f in enumerate(plan.files) if f.name in skip}
        self.data_starts = [file_layout(f).data_start for f in plan.files]  # by file index: _placed asks per step
        self.kernel_copies = hasattr(os, "copy_file_range")  # until a copy is refused (_CANNOT_COPY)

    def _fd(self, index: int) -> int:
        with self.opening:
            if index not in self.fds:  # readable too: copied pieces are read back to check them (copy_part)
                self.fds[index] = os.open(self.stage / self.plan.files[index].name, os.O_RDWR)
            return self.fds[index]

    def put(self, spec: OutputSpec, tensor: torch.Tensor) -> None:
        planned = self._placed(spec)[2]
        size = tensor.numel() * tensor.element_size()
        if size != planned:
            raise MergerError(f"output {spec.name} has {size} bytes, planned {planned}")
        self.put_part(spec, Runs(0, tensor.numel()), tensor)

    def _placed(self, spec: OutputSpec) -> tuple[int, int, int]:
        """(file index, byte offset of output `spec`'s tensor in its file, its planned bytes)."""
        index, entry = self.plan.location[spec.name]
        return index, self.data_starts[index] + entry.begin, entry.end - entry.begin

    @staticmethod
    def _check_fit(spec: OutputSpec, runs: Runs, nbytes: int, item: int, planned: int) -> None:
        """A part of output `spec` (`planned` bytes) of `nbytes`, to lie in `runs` of elements of `item` bytes: an
        error if it does not fill them or they end past the tensor."""
        last = runs.start + sum((n - 1) * s for n, s in zip(runs.outer, runs.strides)) + runs.length
        if nbytes != runs.count * runs.length * item or (runs.count and last * item > planned):
            raise MergerError(f"output {spec.name}: {nbytes} bytes in runs ending at byte {last * item} "
                              f"do not fit its {planned} planned bytes")

    def put_part(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor, lasting: bool = False) -> None:
        """Write `piece`'s bytes into output `spec` where `runs` (plan.py) puts them: one write per run."""
        index, base, planned = self._placed(spec)
        if index in self.skip:
            return
        data = memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
        item = piece.element_size()
        self._check_fit(spec, runs, len(data), item, planned)
        fd = self._fd(index)
        size = runs.length * item
        for k, start in enumerate(runs.starts()):
            self._write(fd, index, data[k * size:(k + 1) * size], base + start * item, lasting)

    def alignment(self, spec: OutputSpec, runs: Runs, nbytes: int) -> int | None:
        """Where in a page of memory a piece of output `spec` of `nbytes` filling `runs` should start (its first
        run's file offset modulo direct_writes.ALIGN) for its bytes to be written from there past the page cache;
        None where no part of it would go direct."""
        index, base, _ = self._placed(spec)
        at = base + runs.start * spec.dtype.itemsize
        if index in self.skip or self.direct.split(at, runs.length * spec.dtype.itemsize) is None:
            return None
        return at % ALIGN

    def put_lasting(self, spec: OutputSpec, runs: Runs, piece: torch.Tensor) -> None:
        """put_part for a piece in a batch buffer, unchanged until flush_writes returns: its bytes that lie aligned
        (alignment) are written from where they are, after this returns."""
        self.put_part(spec, runs, piece, lasting=True)

    def copy_part(self, spec: OutputSpec, runs: Runs, source: int, source_at: int,
                  source_name: str) -> Placed | None:
        """Copy a piece that lies in the open source file `source` from byte `source_at` on, contiguous and exactly
        as output `spec` holds it (its dtype, little-endian), to where `runs` puts it, inside the kernel: the bytes
        never pass through this process. Returns where they went, for a check to read them back; None when nothing
        was copied and the piece must go through memory (`put_part`): its file is reused by a resumed merge, or
        this kernel or filesystem cannot copy between the two files."""
        if not self.kernel_copies:
            return None
        index, base, planned = self._placed(spec)
        if index in self.skip:
            return None
        item = spec.dtype.itemsize
        self._check_fit(spec, runs, runs.count * runs.length * item, item, planned)
        fd, size, path = self._fd(index), runs.length * item, self.stage / self.plan.files[index].name
        placed = Placed(str(path), fd, [])
        for k, start in enumerate(runs.starts()):
            at, src, end = base + start * item, source_at + k * size, source_at + (k + 1) * size
            placed.runs.append((at, size))
            while src < end:
                try:
                    n = copy_at(fd, source, src, at, min(COPY_CHUNK, end - src), self.take_turns)
                except OSError as e:
                    if e.errno in _CANNOT_COPY:  # none will work; put_part writes the whole piece again
                        self.kernel_copies = False
                        return None
                    raise TargetError(f"cannot write the merged model ({e.strerror}), {path}") from e
                if n == 0:
                    raise source_shrank(source_name, end)
                src, at = src + n, at + n
        return placed

    def write_crcs(self, files: frozenset[int], block: int) -> WrittenCrcs:
        """From now on, take the CRC-32 of the bytes written from memory into `files`, per block of `block`
        bytes (written_crcs.py): the checksums then need no read of the output."""
        self.crcs = WrittenCrcs(files, block)
        return self.crcs

    def _write(self, fd: int, index: int, data: memoryview, at: int, lasting: bool = False) -> None:
        direct = self.direct.split(at, len(data))
        try:
            if direct is not None:
                start, end = direct
                self._write_buffered(fd, index, data[:start - at], at)
                # the middle's CRC taken from the bounce buffer, each chunk right after its copy, while it is cached
                seen = None if self.crcs is None else lambda chunk, chunk_at: self.crcs.add(index, chunk, chunk_at)
                done = self.direct.write(self.stage / self.plan.files[index].name, data[start - at:end - at], start,
                                         seen, lasting)
                data, at = data[start - at + done:], start + done  # the tail, or what went no further
            self._write_buffered(fd, index, data, at)
        except OSError as e:  # an earlier direct write's, into another file perhaps, names its file
            raise TargetError(f"cannot write the merged model ({e.strerror}), "
                              f"{e.filename or self.stage / self.plan.files[index].name}") from e

    def _write_buffered(self, fd: int, index: int, data: memoryview, at: int) -> None:
        if self.crcs is not None:
            self.crcs.add(index, data, at)
        while len(data):
            n = write_at(fd, data[:WRITE_CHUNK], at, self.take_turns)
            data, at = data[n:], at + n

    def flush_writes(self) -> None:
        """Wait for the direct writes in flight: the bytes handed over so far are then in their files."""
        try:
            self.direct.flush()
        except OSError as e:
            raise TargetError(f"cannot write the merged model ({e.strerror}), {e.filename}") from e

    def written_mark(self) -> int:
        """A mark of the writes handed over so far, for `wait_written` (taken on any thread)."""
        return self.direct.mark()

    def wait_written(self, mark: int) -> None:
        """Wait until the bytes handed over before `mark` was taken are in their files: those written buffered
        are once their write returned, those written direct once their thread wrote them. Unlike flush_writes, it
        does not wait for the writes handed over since, so that another thread than the writer (the checksum
        thread) waits a bounded time while the writer goes on."""
        try:
            self.direct.wait_written(mark)
        except OSError as e:
            raise TargetError(f"cannot write the merged model ({e.strerror}), {e.filename}") from e

    def sync(self, indices) -> None:
        """Flush and close the files this rank wrote among `indices` (they are complete: none writes them again)."""
        self.flush_writes()
        for index in indices:
            with self.opening:
                fd = self.fds.pop(index, None)
            if fd is None:
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                raise TargetError(f"cannot write the merged model ({e.strerror}), "
                                  f"{self.stage / self.plan.files[index].name}") from e
            finally:
                os.close(fd)
                self.direct.close(self.stage / self.plan.files[index].name)

    def start_writeback(self) -> None:
        """Let the disk take what was written so far while streaming goes on, so the final fsync is short."""
        with self.opening:
            fds = list(self.fds.values())
        for fd in fds:
            start_writeback(fd)

    def close(self) -> None:
        """Flush and close every file still open; after a failure, the files left open are closed all the same."""
        try:
            self.sync(list(self.fds))
        finally:
            self.direct.shutdown()
            with self.opening:
                fds, self.fds = list(self.fds.values()), {}
            for fd in fds:
                os.close(fd)
            self.direct.close_all()


def _write_into(stage: Path, name: str, data: bytes) -> None:
    """A write into the staging folder; a failure (ENOSPC, EFBIG, EDQUOT...) names the file being written."""
    try:
        (stage / name).write_bytes(data)
    except OSError as e:
        raise TargetError(f"cannot write the merged model ({e.strerror}), {stage / name}") from e


def _copy_hf_files(hf_dir: Path, stage: Path, left_out: tuple[str, ...] = ()) -> list[str]:
    copied = []
    for src in files_to_copy(hf_dir):
        if src.name in left_out:
            continue
        try:
            data = src.read_bytes()  # config and tokenizer files: small
        except OSError as e:
            raise SourceError(f"cannot read ({e.strerror}), {src}") from e
        _write_into(stage, src.name, data)
        copied.append(src.name)
    return copied


def _config_dtype(plan: Plan, out_dtype: torch.dtype | None) -> str | None:
    """The dtype config.json states, as save_pretrained writes it: the model's `dtype`, its first floating-point
    parameter's. At `--dtype X` that is X (the modules transformers keeps in float32 come after the input
    embedding); with `keep`, the first floating-point tensor's in the output's layer order (the input embedding's).
    None: no floating-point weights, nothing to state."""
    dtype = out_dtype or next((e.dtype for f in plan.model_files for e in f.entries if e.dtype.is_floating_point),
                              None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _with_dtype(config: dict, dtype_name: str | None) -> dict:
    """`config` stating `dtype_name` in `dtype` (what transformers 5 writes), and in the older `torch_dtype` too
    where the config has that key: a loader reads either."""
    if dtype_name is None:
        return config
    return {**config, "dtype": dtype_name, **({"torch_dtype": dtype_name} if "torch_dtype" in config else {})}


def _write_config(stage: Path, config: dict) -> None:
    _write_into(stage, "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def finish(stage: Path, plan: Plan, hf_dir: Path | None, out_dtype: torch.dtype | None, manifest: Manifest,
           config_updates: dict | None = None, extra_files: dict[str, str] | None = None,
           beside_config: bool = False, config_removals: tuple[str, ...] = (),
           files_left_out: tuple[str, ...] = ()) -> None:
    """Rank 0, after every rank wrote its bytes: index, config (`config_updates` set, `config_removals`
    deleted), tokenizer files (but `files_left_out`), extra files (relative path -> text, e.g. an adapter's
    config), manifest, in the staging folder.

    `beside_config`: the output joins `hf_dir` itself, the source's config folder (target.py): nothing is copied,
    config.json there is restated only where its dtype is not the weights' (the one change merger makes to it),
    and the manifest lists what the merge adds, which is all a later merge may replace. The move into place
    (`target.place`) is separate so that `--verify` can check the complete folder first.
    """
    if len(plan.model_files) > 1:
        total = sum(f.data_bytes for f in plan.model_files)
        index = {"metadata": {"total_size": total}, "weight_map": plan.weight_map}
        _write_into(stage, INDEX, (json.dumps(index, indent=2) + "\n").encode())
    copied = []
    dtype_name = _config_dtype(plan, out_dtype)
    if hf_dir is not None and beside_config:
        config = json.loads((hf_dir / "config.json").read_text())
        if (restated := _with_dtype(config, dtype_name)) != config:
            _write_config(stage, restated)
    elif hf_dir is not None:  # None: the target is no HF model (an adapter folder): no config to complete
        copied = _copy_hf_files(hf_dir, stage, files_left_out)
        if "config.json" not in copied:
            raise SourceError(f"no config.json to copy (pass --hf_model_config_path), {hf_dir}")
        config = {**_with_dtype(json.loads((stage / "config.json").read_text()), dtype_name), **(config_updates or {})}
        _write_config(stage, {k: v for k, v in config.items() if k not in config_removals})
    for name, text in (extra_files or {}).items():
        (stage / name).parent.mkdir(parents=True, exist_ok=True)
        _write_into(stage, name, text.encode())
    # config.json beside the weights stays the source's, restated or not: never one a later merge may remove.
    added = sorted(p.name for p in stage.iterdir() if not p.name.startswith(MANIFEST) and p.name != "config.json") \
        if beside_config else None
    write_manifest(stage, dataclasses.replace(manifest, copied_files=copied, complete=True, added_files=added))
