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
from dataclasses import dataclass, field
from pathlib import Path

from .catalog import Catalog
from .compare import CompareResult, compare_with_folder
from .dist import Group, on_every_rank, on_rank_zero
from .errors import MergerError
from .mapping import build_mapping, read_config
from .memory import peak_rss_bytes
from .model_class import config_updates
from .options import MergeOptions
from .peer_watch import Cleanup
from .output import (FileSink, check_target, finish, hf_files_to_copy, prepare_files, staging_dir, swap_into_place,
                     write_manifest)
from .plan import Plan, plan_layout
from .progress import Progress
from .resume import FileTracker, resume_candidates, skip_finished, start_manifest, verify_share
from .sources import open_catalog
from .stream import run_plan
from .summary import write_summary
from .units import format_size

log = logging.getLogger("merger")


@dataclass
class Prepared:
    catalog: Catalog
    hf_dir: Path | None  # None: the target is no HF model folder (an adapter folder), nothing to copy from
    config: dict
    plan: Plan
    config_updates: dict = field(default_factory=dict)
    extra_files: dict[str, str] = field(default_factory=dict)


def resolve_hf_dir(catalog: Catalog, options: MergeOptions) -> Path:
    hf_dir = options.hf_model_config_path or catalog.hf_dir
    if hf_dir is None:
        raise MergerError(f"no HF config folder found beside the checkpoint (pass --hf_model_config_path), "
                          f"{catalog.root}")
    if not Path(hf_dir).is_dir():
        raise MergerError(f"HF config folder does not exist, {hf_dir}")
    # Checked now, not at the end: only a regular config.json inside the folder is ever copied.
    if not any(f.name == "config.json" for f in hf_files_to_copy(Path(hf_dir))):
        raise MergerError(f"no config.json (a regular file inside the folder; pass --hf_model_config_path), "
                          f"{hf_dir}")
    return Path(hf_dir)


def prepare(options: MergeOptions, group: Group) -> Prepared:
    """Catalog and plan, identical on every rank, from metadata alone."""
    def build():
        catalog = open_catalog(Path(options.local_dir), options.backend, options.prefix)
        from .lora.adapter_state import is_adapter_state, prepare_adapter_state, refuse_adapter_flags

        if is_adapter_state(catalog):  # accelerate's adapter-only save of a PEFT model: no base weights in it
            return prepare_adapter_state(catalog, options, group.world)
        refuse_adapter_flags(options, catalog)
        hf_dir = resolve_hf_dir(catalog, options)
        config = read_config(hf_dir)
        mapping = build_mapping(catalog, config, options, hf_dir)
        plan = plan_layout(catalog, mapping.steps, group.world, options.max_shard_size, options.max_inflight)
        outputs = {s.name: s.shape for step in plan.steps for s in step.outputs}
        updates = {**config_updates(config, outputs, options.is_value_model, hf_dir), **mapping.config_updates}
        return Prepared(catalog, hf_dir, config, plan, updates, mapping.extra_files)

    return log_prepared(on_every_rank(group, build, options.debug), group)


def log_prepared(prepared: Prepared, group: Group) -> Prepared:
    if group.rank == 0:
        c, p = prepared.catalog, prepared.plan
        log.info("merger: %s checkpoint, %d tensors (%s) in %d files -> %d output files (%s), %d batches, "
                 "%d merge ranks", c.format, len(c.tensors), format_size(c.nbytes), len(c.files), len(p.files),
                 format_size(p.total_bytes), len(p.batches), group.world)
    return prepared


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
                                 debug=options.debug)
    if not result.ok:
        raise MergerError(f"the written output failed verification ({result.differ} tensors differ, "
                          f"{result.missing + result.extra} names disagree, {len(result.problems)} index "
                          f"problems); nothing was moved to the target, {stage}")
    return result


def _stage_and_place(options: MergeOptions, group: Group, prepared: Prepared, target: Path,
                     started: float) -> CompareResult | None:
    """Stream into the staging folder, finish it, verify it when asked, rename it into place.

    On failure the staging folder is removed (or kept for --keep-partial / --resume): the target only
    ever holds a complete model.
    """
    plan, stage = prepared.plan, staging_dir(target)
    reader = open_checked_reader(prepared, group, options.debug)
    manifest: dict = {}

    def setup():
        check_target(target, options.overwrite)
        manifest.update(start_manifest(prepared.catalog, options, plan, group.world))
        if stage.exists() and not options.resume:
            log.info("merger: removing the partial merge left in %s (--resume would reuse it)", stage)
        return resume_candidates(stage, manifest) if options.resume else {}

    def create_files():
        for name in reused:
            manifest["output_files"][name]["sha256"] = reused[name]
        if options.resume:
            log.info("merger: --resume: reusing %d of %d output files (checksums verified) from %s", len(reused),
                     len(plan.files), stage)
        prepare_files(stage, plan, keep=frozenset(reused))
        write_manifest(stage, manifest)

    sink = tracker = None

    def discard() -> None:
        """The staging folder after a failure: kept for --keep-partial / --resume, else removed. Run by rank 0
        on the failure path, or by the lowest surviving rank's peer watch when a rank is lost."""
        if tracker is not None:
            tracker.stop()  # no checksum thread may write into the staging folder while it is removed
        if stage.exists():
            if options.keep_partial or options.resume:
                log.info("merger: kept the partial merge in %s (rerun with --resume to continue from it)", stage)
            else:
                shutil.rmtree(stage, ignore_errors=True)

    cleanup = Cleanup(discard)
    group.clean_up_on_loss(cleanup)
    try:
        candidates = group.all_gather(on_every_rank(group, setup if group.rank == 0 else dict, options.debug))[0]
        # Every rank checks a share of the files to reuse: one read of them in all, spread over the ranks.
        shares = group.all_gather(on_every_rank(
            group, lambda: verify_share(stage, candidates, group.rank, group.world), options.debug))
        reused = {name: candidates[name] for share in shares for name in share}
        on_rank_zero(group, create_files, options.debug)
        todo = skip_finished(plan, set(reused))
        sink = FileSink(stage, plan, skip=frozenset(reused))
        one_host = len(set(group.all_gather(socket.gethostname()))) == 1  # one page cache: hash as batches land
        tracker = FileTracker(todo, sink, group, stage, manifest, one_host)
        progress = Progress(sum(b.out_bytes for b in todo.batches)) if group.rank == 0 else None
        run_plan(todo, prepared.catalog, group, sink, progress, options.debug, reader=reader, observer=tracker)
        on_every_rank(group, sink.close, options.debug)  # a sync point: every rank's bytes are on disk

        def complete():
            finish(stage, plan, prepared.hf_dir, options.torch_dtype, tracker.final_manifest(),
                   prepared.config_updates, prepared.extra_files)

        on_rank_zero(group, complete, options.debug)
        verified = verify_staged(stage, prepared, group, options) if options.verify else None
        # Never at once with the cleanup: a rename during a removal would move a half-removed folder.
        on_rank_zero(group, lambda: cleanup.instead(lambda: swap_into_place(stage, target, options.overwrite)),
                     options.debug)
    except BaseException:
        if tracker is not None:
            tracker.stop()  # no checksum thread may outlive the files it reads
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.close()
        if group.rank == 0:
            cleanup()
        raise
    if group.rank == 0:
        log.info("merger: wrote %s to %s in %.1fs (peak RSS rank 0: %s)", format_size(plan.total_bytes), target,
                 time.monotonic() - started, format_size(peak_rss_bytes()))
    return verified


def run_merge(options: MergeOptions, group: Group, prepared: Prepared | None = None) -> Path:
    """Merge into options.target_dir; `prepared` (catalog and plan) defaults to the checkpoint at local_dir."""
    started = time.monotonic()
    target = Path(options.target_dir).absolute()
    prepared = prepared or prepare(options, group)
    verified, uploaded = None, None
    try:
        verified = _stage_and_place(options, group, prepared, target, started)
        if options.hf_upload_path:
            from .publish import upload

            def publish():
                nonlocal uploaded
                uploaded = upload(target, options.hf_upload_path, options.private)

            on_rank_zero(group, publish, options.debug)  # one rank uploads; every rank learns if it failed
    except MergerError as e:
        if options.summary_json:
            write_summary(options.summary_json, prepared, options, group, started, verified, uploaded, str(e))
        raise
    if options.summary_json:
        write_summary(options.summary_json, prepared, options, group, started, verified, uploaded, None)
    return target
