"""A local folder as a merge's target (the `Target` protocol, output/target.py): the staging folder opened under the
target's lock, the files an interrupted merge finished taken over, the rest written, completed and renamed into the
target; or, on failure, removed (or kept for --resume). The folder's own rules are in target_folder.py."""
from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

from ..engine.dist import Group, on_every_rank, on_rank_zero
from ..engine.peer_watch import Cleanup
from ..engine.prepared import Prepared
from ..engine.progress import Progress, shown as progress_shown
from ..engine.stream import run_plan
from ..errors import Interrupted, TargetError
from ..io import is_remote, location
from ..options import MergeOptions
from .files import FileSink, finish, prepare_files
from .manifest import write_manifest
from .part_stream import StreamedUpload
from .resume import (FileTracker, intact_files, resume_candidates, skip_finished, start_manifest, verify_share,
                     why_not_done)
from .safetensors_layout import file_sizes
from .source_identity import check_unchanged, source_identity
from .target_folder import TargetFolder, check_config_dir_entries, place, resolve_target
from .target_lock import TargetLock
from .write_turns import host_local, should_take_turns

log = logging.getLogger("merger")


def _source_paths(options: MergeOptions, prepared: Prepared) -> list[Path]:
    """Every folder and file the merge reads: a target may be none of them, hold none and lie in none."""
    c = prepared.catalog
    paths = [options.local_dir, c.root, *{location(f).parent for f in c.files}]
    paths += [prepared.hf_dir, prepared.base_model, options.adapter_config]
    return [Path(p) for p in paths if p is not None and not is_remote(p)]  # a bucket's objects lie in no folder


def _open_folder(options: MergeOptions, prepared: Prepared) -> TargetFolder:
    """Rank 0: where the output goes, checked against the source, before anything is written."""
    target = resolve_target(Path(options.target_dir), _source_paths(options, prepared), prepared.hf_dir,
                            prepared.catalog.files)
    if target.earlier and not (options.overwrite or options.resume):
        target.refuse_earlier()
    if target.beside_config:
        changed = [*prepared.config_updates, *prepared.config_removals]
        if changed:
            raise TargetError(f"the merged model needs changes to config.json ({', '.join(changed)}), "
                              f"and merger does not change the checkpoint's own config folder: choose a --target_dir "
                              f"outside the checkpoint, {target.path}")
        added = {f.name.split("/")[0] for f in prepared.plan.files} | {n.split("/")[0] for n in prepared.extra_files}
        check_config_dir_entries(target, sorted(added | {"model.safetensors.index.json"}), options.overwrite)
        log.info("merger: adding the weights to the checkpoint's config folder %s, beside its config and tokenizer "
                 "(config.json is left as it is, but for a dtype that is not the weights')", target.path)
    return target


class LocalTarget:
    """One merge into a local folder, and what its steps share (the folder, its lock, the manifest, the sink and the
    checksum threads), so that a failure at any step, or a lost rank, discards exactly what was made.

    `stream`: a bucket target's uploads, whose parts the checksum threads send while the merge streams
    (object_store_target.py merges through a local target). `temporary`: the folder is one the caller removes at
    the end (a bucket merge without --stage_dir), so nothing is kept to resume."""

    def __init__(self, options: MergeOptions, group: Group, prepared: Prepared, stream: StreamedUpload | None = None,
                 temporary: bool = False):
        self.options, self.group, self.prepared, self.plan = options, group, prepared, prepared.plan
        self.stream, self.temporary = stream, temporary
        # and after Ctrl-C (fail): a user who stops a merge may resume it (not from a folder removed at the end)
        self.keep = (options.keep_partial or options.resume) and not temporary
        self.lock: TargetLock | None = None  # rank 0's, once taken
        self.folder: TargetFolder | None = None  # every rank's, once open() agreed on it
        self.sources: dict = {}  # rank 0: the source files' identity, from before the first tensor byte is read
        self.manifest = self.candidates = None
        self.reused: dict = {}  # output file name -> its checksummed blocks, for the files a resumed merge finished
        self.sink: FileSink | None = None
        self.tracker: FileTracker | None = None
        self.cleanup = Cleanup(self.discard)  # run at most once: by fail(), or by the peer watch when a rank is lost

    @property
    def where(self) -> str:
        return str(self.folder.path)

    @property
    def written(self) -> Path:
        """The folder holding the finished files before commit(): what --verify reads."""
        return self.folder.stage

    def open(self) -> bool:
        """The target, checked and locked by rank 0, known to every rank; False when --resume finds the merge done
        already (there is nothing to write)."""
        opened = on_every_rank(self.group, self._open if self.group.rank == 0 else lambda: (None, None, None),
                               self.options.debug)
        self.folder, self.manifest, self.candidates = self.group.all_gather(opened)[0]
        return self.manifest is not None

    def _open(self):
        """Rank 0: the target, its lock taken, and the manifest this merge will write and the files of a kept
        staging folder it may reuse; or the target and no manifest, when --resume finds this merge finished."""
        options = self.options
        target = _open_folder(options, self.prepared)
        self.lock = TargetLock(target.lock, target.path)
        self.lock.acquire()  # before the staging folder is touched: it may be another merge's, live
        self.sources.update(source_identity(self.prepared.catalog))
        manifest = start_manifest(self.prepared.catalog, self.sources, options, self.plan, self.group.world)
        if target.earlier and not options.overwrite:  # --resume: the merge may have finished already
            reason = why_not_done(target.path, manifest)
            if reason is None:
                log.info("merger: --resume: %s already holds this merge, complete and intact: nothing to do",
                         target.path)
                return target, None, None
            log.info("merger: --resume: the merge at %s is not this one (%s)", target.path, reason)
            target.refuse_earlier()
        if target.stage.exists() and not options.resume:
            if not options.overwrite:  # kept on purpose (--keep-partial, Ctrl-C), or left by a killed merge
                raise TargetError(f"a partial merge is kept in {target.stage}: pass --resume to continue it, or "
                                  f"--overwrite to start over, {target.path}")
            log.info("merger: --overwrite: removing the partial merge left in %s", target.stage)
        return target, manifest, resume_candidates(target.stage, manifest) if options.resume else {}

    def prepare(self) -> None:
        """The files an interrupted merge finished, checked (every rank a share of their blocks: one read of them,
        spread over the ranks) and kept; the staging folder made, the rest of its files created."""
        group, stage, debug = self.group, self.folder.stage, self.options.debug
        shares = group.all_gather(on_every_rank(
            group, lambda: verify_share(stage, self.manifest, self.candidates, group.rank, group.world), debug))
        self.reused = intact_files(self.candidates, shares)
        on_rank_zero(group, self._create_files, debug)

    def _create_files(self) -> None:
        for name, blocks in self.reused.items():
            self.manifest.output_files[name].crc32_blocks = blocks
        if self.options.resume:
            log.info("merger: --resume: reusing %d of %d output files (checksums verified) from %s",
                     len(self.reused), len(self.plan.files), self.folder.stage)
        # An s3:// target's stage keeps on disk only the parts in flight: its blocks are never all reserved, and it
        # needs room for those, not for the model.
        room = None if self.stream is None else self.stream.room(
            file_sizes(f for f in self.plan.files if f.name not in self.reused), self.manifest.checksum_block_bytes,
            self.plan.max_inflight, self.group.world)
        prepare_files(self.folder.stage, self.plan, keep=frozenset(self.reused), allocate=self.stream is None,
                      room=room)
        write_manifest(self.folder.stage, self.manifest)

    def write(self, reader) -> None:
        """Stream the plan's files not reused into the staging folder, each block checksummed as it lands (and an
        s3:// target's parts sent); returns once every rank's bytes are on disk and its checksums done."""
        group, stage, plan, debug = self.group, self.folder.stage, self.plan, self.options.debug
        reused = frozenset(self.reused)
        todo = skip_finished(plan, set(reused))
        hosts = group.hosts
        one_host = len(set(hosts)) == 1  # one page cache: hash as batches land
        # On a host-local filesystem the pieces that lie aligned in the batch buffers are written past the page cache
        # (direct_writes.py); ranks that take turns at a file (several on this host) write the rest so too, through
        # bounce buffers, while a rank alone on its host writes it buffered, as cheap as the bounce copy.
        # An s3:// target's parts are read back from the stage as they are sent, where the page cache holds them.
        local = host_local(stage)
        turns = should_take_turns(local, hosts.count(hosts[group.rank]))
        self.sink = FileSink(stage, plan, skip=reused, take_turns=turns, direct=local and self.stream is None,
                             bounce=turns)
        sender = None if self.stream is None else self.stream.begin(
            group, file_sizes(plan.files), reused, self.manifest.checksum_block_bytes, debug)
        self.tracker = FileTracker(todo, self.sink, group, stage, self.manifest, one_host, sender)
        progress = Progress(sum(b.out_bytes for b in todo.batches)) if group.rank == 0 and progress_shown() else None
        run_plan(todo, self.prepared.catalog, group, self.sink, progress, debug, reader=reader, observer=self.tracker,
                 allow_overflow=self.options.allow_overflow)
        on_every_rank(group, self._close, debug)  # a sync point: every rank's bytes on disk, its checksums done
        self.manifest = self.tracker.final_manifest()
        if self.stream is not None:
            self.stream.etags.update(self.tracker.etags)

    def _close(self) -> None:
        self.sink.close()
        self.tracker.wait()

    def finish(self) -> None:
        """Rank 0: the index, config, tokenizer and other files, and the manifest saying the merge is complete."""
        prepared = self.prepared
        on_rank_zero(self.group, lambda: finish(
            self.folder.stage, self.plan, prepared.hf_dir, self.options.torch_dtype, self.manifest,
            prepared.config_updates, prepared.extra_files, beside_config=self.folder.beside_config,
            config_removals=prepared.config_removals, files_left_out=prepared.files_left_out), self.options.debug)

    def commit(self) -> None:
        """Rank 0: the staging folder renamed into the target, if the sources are still what was read. Never at
        once with the cleanup: a rename during a removal would move a half-removed folder."""
        on_rank_zero(self.group, lambda: self.cleanup.instead(self._move_into_place), self.options.debug)

    def _move_into_place(self) -> None:
        check_unchanged(self.prepared.catalog, self.sources)  # what was read is what the source still is
        place(self.folder, self.options.overwrite)

    def fail(self, e: BaseException) -> None:
        """After any failure, on every rank: no checksum thread left running, the files closed; rank 0 discards
        (or keeps) the staging folder, and after Ctrl-C raises Interrupted saying where the partial merge is."""
        if self.tracker is not None:
            self.tracker.stop()  # no checksum thread may outlive the files it reads
        if self.sink is not None:
            with contextlib.suppress(Exception):
                self.sink.close()
        ctrl_c = isinstance(e, KeyboardInterrupt) and str(e) in ("", "SIGINT")  # the handler's SIGTERM has args
        self.keep = self.keep or (ctrl_c and not self.temporary)
        if self.group.rank == 0 and self.cleanup is not None:  # None: released already, by a peer watch's cleanup
            self.cleanup()
            if ctrl_c and self.folder is not None and self.folder.stage.exists():
                raise Interrupted("SIGINT", f"the partial merge is kept in {self.folder.stage}: rerun with --resume "
                                            f"to continue it, or --overwrite to start over") from e

    def discard(self) -> None:
        """After a failure: the staging folder kept for --keep-partial / --resume / Ctrl-C, else removed; the
        target's lock released. Run by rank 0 on the failure path, or by the lowest surviving rank's peer watch
        when a rank is lost (every rank knows the target once open() is agreed)."""
        if self.tracker is not None:
            self.tracker.stop()  # no checksum thread may write into the staging folder while it is removed
        if self.folder is not None and self.folder.stage.exists():
            if self.keep:
                log.info("merger: kept the partial merge in %s (rerun with --resume to continue from it)",
                         self.folder.stage)
            else:
                shutil.rmtree(self.folder.stage, ignore_errors=True)
        self.release()

    def release(self) -> None:
        """The end of the staging step, whichever way it ended: the lock released, and the cleanup dropped. The
        cleanup holds this object (discard), a cycle only the garbage collector frees, which kept the merge's buffers
        and gloo's last collectives alive into a trainer's interpreter teardown, aborting it now and then ("terminate
        called without an active exception": Group.close says why). A peer watch that still holds it keeps it."""
        if self.lock is not None:
            self.lock.release()
        self.cleanup = None
