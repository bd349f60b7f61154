"""The merge operation: catalog, plan, then the target's steps (output/target.py). Runs on every rank.

Each phase ends at a sync point where every rank learns whether any rank failed, so an error on one rank
stops all of them with the same message and no rank is left waiting in a collective.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from ..catalog import Catalog
from ..engine.compare import CompareResult, compare_with_folder
from ..engine.dist import Group, on_every_rank, on_rank_zero
from ..engine.memory import peak_rss_per_rank
from ..engine.plan import Plan, plan_layout
from ..engine.plan_agreement import agree_on_plan, source_files
from ..engine.prepared import Prepared
from ..engine.tie_check import settle_tie
from ..errors import AgreedError, MergerError
from ..io import location
from ..mapping.hub_folders import with_hub_folders
from ..mapping.registry import build_mapping
from ..options import MergeOptions
from ..output.summary import merge_summary, write_summary
from ..output.target import Target, target_of
from ..sources import open_catalog
from ..units import format_size

log = logging.getLogger("merger")


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


def _write(options: MergeOptions, group: Group, prepared: Prepared, started: float) -> CompareResult | None:
    """Take the target through its steps (output/target.py), verifying what was written when asked.

    On failure the target discards what was made (or keeps it for --keep-partial / --resume, and after Ctrl-C): it
    only ever holds a complete model; a kept one is replaced only with --overwrite. Rank 0 holds the target's lock
    throughout, so no other merge writes there."""
    reader = open_checked_reader(prepared, group, options.debug)  # bad input fails before anything is created
    target = target_of(options, group, prepared)
    group.clean_up_on_loss(target.cleanup)
    try:
        if not target.open():
            return None  # --resume found the merge finished
        target.prepare()
        target.write(reader)
        target.finish()
        verified = verify_staged(target.written, prepared, group, options) if options.verify else None
        target.commit()
    except BaseException as e:
        target.fail(e)
        raise
    finally:
        target.release()
    _log_written(target, prepared.plan, group, started)
    return verified


def _log_written(target: Target, plan: Plan, group: Group, started: float) -> None:
    """Rank 0 says what was written where, in how long, and the most memory a rank needed (a collective)."""
    peaks = peak_rss_per_rank(group)  # the largest of them is what a rank needs: rank 0 may have held least
    if group.rank == 0:
        peak = max(range(group.world), key=peaks.__getitem__)
        log.info("merger: wrote %s to %s in %.1fs (peak RSS: %s%s)", format_size(plan.total_bytes), target.where,
                 time.monotonic() - started, format_size(peaks[peak]),
                 f", rank {peak} of {group.world}" if group.distributed else "")


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
        verified = _write(options, group, prepared, started)
        if options.hf_upload_path:
            from ..output.publish import upload_merged

            folder = Path(options.target_dir).absolute()
            # one rank uploads; every rank learns if it failed
            uploaded = on_rank_zero(group, lambda: upload_merged(folder, options.hf_upload_path, options.private),
                                    options.debug)
    except MergerError as e:
        if options.summary_json:
            summary(str(e))
        raise
    return summary(None)
