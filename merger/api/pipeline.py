"""The merge operation: catalog, plan, stream into a staging folder, finish, rename. Runs on every rank.

Each phase ends at a sync point where every rank learns whether any rank failed, so an error on one rank
stops all of them with the same message and no rank is left waiting in a collective.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from ..engine.compare import CompareResult, compare_with_folder
from ..engine.dist import Group, on_every_rank, on_rank_zero
from ..engine.memory import peak_rss_per_rank
from ..engine.peer_watch import Cleanup
from ..engine.plan import Plan, plan_layout
from ..engine.plan_agreement import agree_on_plan, source_files
from ..engine.progress import Progress, shown as progress_shown
from ..engine.stream import run_plan
from ..engine.tie_check import settle_tie
from ..errors import AgreedError, Interrupted, MergerError, TargetError
from ..io import is_remote, location
from ..mapping.hub_folders import with_hub_folders
from ..mapping.registry import build_mapping
from ..options import MergeOptions
from ..output.files import FileSink, finish, prepare_files
from ..output.manifest import write_manifest
from ..output.part_stream import StreamedUpload
from ..output.resume import (FileTracker, intact_files, resume_candidates, skip_finished, start_manifest,
                            verify_share, why_not_done)
from ..output.source_identity import check_unchanged, source_identity
from ..output.summary import merge_summary, write_summary
from ..output.target import Target, check_config_dir_entries, place, resolve_target
from ..output.target_lock import TargetLock
from ..output.write_turns import host_local, should_take_turns
from ..sources import open_catalog
from ..units import format_size
from .bucket_merge import merge_into_bucket

log = logging.getLogger("merger")


@dataclass
class Prepared:
    catalog: Catalog  # what the plan reads: the checkpoint, or it and a base model (mapping.catalog)
    hf_dir: Path | None  # None: the target is no HF model folder (an adapter folder), nothing to copy from
    plan: Plan
    config_updates: dict = field(default_factory=dict)
    config_removals: tuple[str, ...] = ()
    files_left_out: tuple[str, ...] = ()  # files of hf_dir not copied (Mapping.files_left_out)
    extra_files: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what the merge found and does, logged once by rank 0
    base_model: Path | None = None  # --base_model's folder (a Hub id's snapshot folder), a source like the others


def prepare(options: MergeOptions, group: Group, plan_world: int | None = None, check_sizes: bool = True) -> Prepared:
    """Catalog, mapping and plan, identical on every rank, from metadata alone (but for the values of a tied
    lm_head and input embedding, compared when the source holds both): the one place a plan is made.
    `plan_world`: the merge ranks to plan for, when not the group's (`inspect --merge_ranks` plans in one process).
    `check_sizes` False: the caller checks each file's size itself (`inspect --check` names every bad file)."""
    def build():
        source = open_catalog(location(options.local_dir), options.backend, options.prefix)
        local = with_hub_folders(options)  # Hub ids among the flags: their snapshot folders
        return source, local, build_mapping(source, local)

    source, local, mapping = on_every_rank(group, build, options.debug)
    catalog = mapping.catalog or source
    if check_sizes:
        on_every_rank(group, lambda: _check_sizes(catalog, group), options.debug)
    files = source_files(catalog) if group.distributed else []  # stat'ed once, compared twice
    agree_on_plan(catalog, None, group, files)  # the tie check below already exchanges pieces: agree first
    mapping = settle_tie(mapping, catalog, group, options)  # reads lm_head and the input embedding: a collective

    def layout():
        plan = plan_layout(catalog, mapping.steps, plan_world or group.world, options.max_shard_size,
                           options.max_inflight, tie=mapping.tie)
        return Prepared(catalog, mapping.hf_dir, plan, mapping.config_updates, mapping.config_removals,
                        mapping.files_left_out, mapping.extra_files, source.notes + mapping.notes, local.base_model)

    prepared = on_every_rank(group, layout, options.debug)
    agree_on_plan(prepared.catalog, prepared.plan, group, files)  # before anything is written: one merge, not a mix
    return log_prepared(prepared, group)


def _check_sizes(catalog: Catalog, group: Group) -> None:
    """Each rank's files against their own directories or the checkpoint's metadata (Catalog.check_file): a file cut
    short is one line naming it before the plan, and before anything reads it (the tie check below may).
    `inspect` plans in one process for any rank count, so it checks every file."""
    if catalog.check_file:
        for file in catalog.files_of_rank(group.rank, group.world):
            catalog.check_file(file)


def log_prepared(prepared: Prepared, group: Group) -> Prepared:
    if group.rank == 0:
        c, p = prepared.catalog, prepared.plan
        log.info("merger: %s checkpoint, %d tensors (%s) in %d files -> %d output files (%s, %s), %d batches, "
                 "%d merge ranks", c.format, len(c.tensors), format_size(c.nbytes), len(c.files), len(p.files),
                 format_size(p.total_bytes), _output_dtypes(p), len(p.batches), p.world)
        for note in prepared.notes:
            log.info(note)
    return prepared


def _output_dtypes(plan: Plan) -> str:
    """The dtypes the output is written in, e.g. `bfloat16` or `bfloat16: 290 tensors, float32: 2`."""
    counts = Counter(str(e.dtype).removeprefix("torch.") for f in plan.files for e in f.entries)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name}: {n} tensor{'s' * (n != 1)}" for name, n in counts.most_common())


def open_checked_reader(prepared: Prepared, group: Group, debug: bool = False):
    """Every rank opens its source files and checks them against the catalog, before any output exists."""
    def check():
        reader = prepared.catalog.open_reader()
        reader.check_files(prepared.catalog.files_of_rank(group.rank, group.world))
        return reader

    return on_every_rank(group, check, debug)


def verify_staged(stage: Path, prepared: Prepared, group: Group, options: MergeOptions) -> CompareResult:
    """Re-run the plan against what was written: every tensor byte-equal to its source after the same cast,
    the files' headers and index sound. Raises on every rank when anything is off."""
    result = compare_with_folder(prepared.plan, prepared.catalog, group, stage, cast=False, label="verify",
                                 debug=options.debug, allow_overflow=options.allow_overflow)
    if not result.ok:  # every rank has the same result (gathered): one line, from rank 0
        raise AgreedError(f"the written output failed verification ({result.differ} tensors differ, "
                          f"{result.missing + result.extra} names disagree, {len(result.problems)} index "
                          f"problems); nothing was moved to the target, {stage}")
    return result


def _source_paths(options: MergeOptions, prepared: Prepared) -> list[Path]:
    """Every folder and file the merge reads: a target may be none of them, hold none and lie in none."""
    c = prepared.catalog
    paths = [options.local_dir, c.root, *{location(f).parent for f in c.files}]
    paths += [prepared.hf_dir, prepared.base_model, options.adapter_config]
    return [Path(p) for p in paths if p is not None and not is_remote(p)]  # a bucket's objects lie in no folder


def _open_target(options: MergeOptions, prepared: Prepared) -> Target:
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


def _stage_and_place(options: MergeOptions, group: Group, prepared: Prepared, started: float,
                     stream: StreamedUpload | None = None, temporary: bool = False) -> CompareResult | None:
    """Stream into the staging folder, finish it, verify it when asked, rename it into place.

    On failure the staging folder is removed (or kept for --keep-partial / --resume, and after Ctrl-C): the
    target only ever holds a complete model; a kept one is replaced only with --overwrite. Rank 0 holds the
    target's lock throughout, so no other merge writes there. `stream`: an s3:// target's uploads, whose parts
    the checksum threads send while the merge streams (output/part_stream.py). `temporary`: the target is a
    folder the caller removes at the end (an s3:// merge without --stage_dir), so nothing is kept to resume.
    """
    plan = prepared.plan
    lock: TargetLock | None = None
    sources: dict = {}  # rank 0: the source files' identity, from before the first tensor byte is read

    def setup():
        nonlocal lock
        target = _open_target(options, prepared)
        lock = TargetLock(target.lock, target.path)
        lock.acquire()  # before the staging folder is touched: it may be another merge's, live
        sources.update(source_identity(prepared.catalog))
        manifest = start_manifest(prepared.catalog, sources, options, plan, group.world)
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

    reader = open_checked_reader(prepared, group, options.debug)  # bad input fails before anything is created
    target = sink = tracker = None
    # and after Ctrl-C: a user who stops a merge may resume it (not from a folder removed at the end)
    keep = (options.keep_partial or options.resume) and not temporary

    def discard() -> None:
        """After a failure: the staging folder kept for --keep-partial / --resume / Ctrl-C, else removed; the
        target's lock released. Run by rank 0 on the failure path, or by the lowest surviving rank's peer watch
        when a rank is lost (every rank knows the target once setup is agreed)."""
        if tracker is not None:
            tracker.stop()  # no checksum thread may write into the staging folder while it is removed
        if target is not None and target.stage.exists():
            if keep:
                log.info("merger: kept the partial merge in %s (rerun with --resume to continue from it)",
                         target.stage)
            else:
                shutil.rmtree(target.stage, ignore_errors=True)
        if lock is not None:
            lock.release()

    cleanup = Cleanup(discard)
    group.clean_up_on_loss(cleanup)
    try:
        target, manifest, candidates = group.all_gather(
            on_every_rank(group, setup if group.rank == 0 else (lambda: (None, None, None)), options.debug))[0]
        if manifest is None:
            return None  # --resume found the merge finished
        stage = target.stage
        # Every rank checks a share of the blocks of the files to reuse: one read of them, spread over the ranks.
        shares = group.all_gather(on_every_rank(
            group, lambda: verify_share(stage, manifest, candidates, group.rank, group.world), options.debug))
        reused = intact_files(candidates, shares)

        def create_files():
            for name, blocks in reused.items():
                manifest.output_files[name].crc32_blocks = blocks
            if options.resume:
                log.info("merger: --resume: reusing %d of %d output files (checksums verified) from %s",
                         len(reused), len(plan.files), stage)
            # (an s3:// target's stage keeps on disk only the parts in flight: its blocks are never all reserved)
            prepare_files(stage, plan, keep=frozenset(reused), allocate=stream is None)
            write_manifest(stage, manifest)

        on_rank_zero(group, create_files, options.debug)
        todo = skip_finished(plan, set(reused))
        hosts = group.all_gather(socket.gethostname())
        one_host = len(set(hosts)) == 1  # one page cache: hash as batches land
        # On a host-local filesystem the pieces that lie aligned in the batch buffers are written past the page cache
        # (direct_writes.py); ranks that take turns at a file (several on this host) write the rest so too, through
        # bounce buffers, while a rank alone on its host writes it buffered, as cheap as the bounce copy.
        # An s3:// target's parts are read back from the stage as they are sent, where the page cache holds them.
        local = host_local(stage)
        turns = should_take_turns(local, hosts.count(hosts[group.rank]))
        sink = FileSink(stage, plan, skip=frozenset(reused), take_turns=turns, direct=local and stream is None,
                        bounce=turns)
        sender = None if stream is None else stream.begin(
            group, {f.name: f.size for f in plan.files}, frozenset(reused), manifest.checksum_block_bytes,
            options.debug)
        tracker = FileTracker(todo, sink, group, stage, manifest, one_host, sender)
        progress = Progress(sum(b.out_bytes for b in todo.batches)) if group.rank == 0 and progress_shown() else None
        run_plan(todo, prepared.catalog, group, sink, progress, options.debug, reader=reader, observer=tracker,
                 allow_overflow=options.allow_overflow)

        def close():
            sink.close()
            tracker.wait()

        on_every_rank(group, close, options.debug)  # a sync point: every rank's bytes on disk, its checksums done
        manifest = tracker.final_manifest()
        if stream is not None:
            stream.etags.update(tracker.etags)

        def complete():
            finish(stage, plan, prepared.hf_dir, options.torch_dtype,
                   manifest, prepared.config_updates, prepared.extra_files,
                   beside_config=target.beside_config, config_removals=prepared.config_removals,
                   files_left_out=prepared.files_left_out)

        on_rank_zero(group, complete, options.debug)
        verified = verify_staged(stage, prepared, group, options) if options.verify else None

        def move_into_place():
            check_unchanged(prepared.catalog, sources)  # what was read is what the source still is
            place(target, options.overwrite)

        # Never at once with the cleanup: a rename during a removal would move a half-removed folder.
        on_rank_zero(group, lambda: cleanup.instead(move_into_place), options.debug)
    except BaseException as e:
        if tracker is not None:
            tracker.stop()  # no checksum thread may outlive the files it reads
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.close()
        ctrl_c = isinstance(e, KeyboardInterrupt) and str(e) in ("", "SIGINT")  # the handler's SIGTERM has args
        keep = keep or (ctrl_c and not temporary)
        if group.rank == 0:
            cleanup()
            if ctrl_c and target is not None and target.stage.exists():
                raise Interrupted("SIGINT", f"the partial merge is kept in {target.stage}: rerun with --resume "
                                            f"to continue it, or --overwrite to start over") from e
        raise
    finally:
        if lock is not None:
            lock.release()
    peaks = peak_rss_per_rank(group)  # the largest of them is what a rank needs: rank 0 may have held least
    if group.rank == 0:
        peak = max(range(group.world), key=peaks.__getitem__)
        log.info("merger: wrote %s to %s in %.1fs (peak RSS: %s%s)", format_size(plan.total_bytes), target.path,
                 time.monotonic() - started, format_size(peaks[peak]),
                 f", rank {peak} of {group.world}" if group.distributed else "")
    return verified


def run_merge(options: MergeOptions, group: Group, prepared: Prepared | None = None) -> dict:
    """Merge into options.target_dir and say what was done (output/summary.py), on every rank; `prepared`
    (catalog and plan) defaults to the checkpoint at local_dir."""
    started = time.monotonic()
    prepared = prepared or prepare(options, group)
    verified, uploaded = None, None

    def summary(error: str | None) -> dict:
        said = merge_summary(prepared.catalog, prepared.plan, options, group, started, verified, uploaded, error)
        if options.summary_json:
            write_summary(options.summary_json, said, group)
        return said

    try:
        if is_remote(options.target_dir):
            verified = merge_into_bucket(options, group, lambda local, stream, temporary: _stage_and_place(
                local, group, prepared, started, stream, temporary))
        else:
            verified = _stage_and_place(options, group, prepared, started)
        if options.hf_upload_path:
            from ..output.publish import upload_merged

            def publish():
                nonlocal uploaded
                uploaded = upload_merged(Path(options.target_dir).absolute(), options.hf_upload_path,
                                         options.private)

            on_rank_zero(group, publish, options.debug)  # one rank uploads; every rank learns if it failed
    except MergerError as e:
        if options.summary_json:
            summary(str(e))
        raise
    return summary(None)
