"""The merge operation: catalog, plan, stream into a staging folder, finish, rename. Runs on every rank.

Each phase ends at a sync point where every rank learns whether any rank failed, so an error on one rank
stops all of them with the same message and no rank is left waiting in a collective.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import __version__
from .catalog import Catalog
from .compare import CompareResult, compare_with_folder
from .dist import Group
from .errors import MergerError, describe_error
from .mapping import build_steps, read_config
from .memory import peak_rss_bytes
from .model_class import config_updates
from .options import MergeOptions
from .output import FileSink, check_target, finish, prepare_files, staging_dir, swap_into_place
from .plan import Plan, plan_layout
from .progress import Progress
from .sources import open_catalog
from .stream import run_plan
from .units import format_size

log = logging.getLogger("merger")


def on_every_rank(group: Group, fn: Callable[[], object], debug: bool = False):
    """Run fn here, then sync: if it failed on any rank, raise the same MergerError on all of them."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the error must reach the sync point
        error = describe_error(e, group.rank, debug)
    group.agree(error)
    return result


def on_rank_zero(group: Group, fn: Callable[[], object], debug: bool = False) -> None:
    on_every_rank(group, fn if group.rank == 0 else (lambda: None), debug)


@dataclass
class Prepared:
    catalog: Catalog
    hf_dir: Path
    config: dict
    plan: Plan
    config_updates: dict


def resolve_hf_dir(catalog: Catalog, options: MergeOptions) -> Path:
    hf_dir = options.hf_model_config_path or catalog.hf_dir
    if hf_dir is None:
        raise MergerError(f"no HF config folder found beside the checkpoint (pass --hf_model_config_path), "
                          f"{catalog.root}")
    if not Path(hf_dir).is_dir():
        raise MergerError(f"HF config folder does not exist, {hf_dir}")
    return Path(hf_dir)


def prepare(options: MergeOptions, group: Group) -> Prepared:
    """Catalog and plan, identical on every rank, from metadata alone."""
    def build():
        catalog = open_catalog(Path(options.local_dir), options.backend)
        hf_dir = resolve_hf_dir(catalog, options)
        config = read_config(hf_dir)
        steps = build_steps(catalog, config, options, hf_dir)
        plan = plan_layout(catalog, steps, group.world, options.max_shard_size, options.max_inflight)
        outputs = {s.name: s.shape for step in plan.steps for s in step.outputs}
        return Prepared(catalog, hf_dir, config, plan,
                        config_updates(config, outputs, options.is_value_model, hf_dir))

    prepared = on_every_rank(group, build, options.debug)
    if group.rank == 0:
        c, p = prepared.catalog, prepared.plan
        log.info("merger: %s checkpoint, %d tensors (%s) in %d files -> %d output files (%s), %d batches, "
                 "%d merge ranks", c.format, len(c.tensors), format_size(c.nbytes), len(c.files), len(p.files),
                 format_size(p.total_bytes), len(p.batches), group.world)
    return prepared


def source_fingerprint(catalog: Catalog) -> dict[str, dict[str, float]]:
    out = {}
    for f in catalog.files:
        st = os.stat(f)
        out[f] = {"size": st.st_size, "mtime": st.st_mtime}
    return out


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


def write_summary(path: Path, prepared: Prepared, options: MergeOptions, group: Group, started: float,
                  verify: CompareResult | None, uploaded: str | None, error: str | None) -> None:
    """`--summary-json`: what was merged, by how many ranks, into what, how fast, how much memory, verified."""
    peaks = group.gather_object(peak_rss_bytes())
    if group.rank != 0:
        return
    c, plan = prepared.catalog, prepared.plan
    summary = {
        "status": "failed" if error else "ok", "error": error,
        "source_format": c.format, "source_dir": str(Path(options.local_dir).absolute()),
        "checkpoint_world_size": c.details.get("world_size"), "merge_world_size": group.world,
        "target_dir": str(Path(options.target_dir).absolute()), "dtype": options.dtype,
        "tensors": len(plan.location), "bytes": plan.total_bytes,
        "output_files": [{"name": f.name, "bytes": f.size, "tensors": len(f.entries)} for f in plan.files],
        "wall_time_s": round(time.monotonic() - started, 3), "peak_rss_bytes_per_rank": peaks,
        "verify": verify.as_dict() if verify else None, "uploaded_to": uploaded,
    }
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def _stage_and_place(options: MergeOptions, group: Group, prepared: Prepared, target: Path,
                     started: float) -> CompareResult | None:
    """Stream into the staging folder, finish it, verify it when asked, rename it into place.

    A failure at any point removes the staging folder: the target only ever holds a complete model.
    """
    plan, stage = prepared.plan, staging_dir(target)

    def setup():
        check_target(target, options.overwrite)
        prepare_files(stage, plan)

    def complete():
        manifest = {
            "merger_version": __version__, "source_format": prepared.catalog.format,
            "source_dir": str(Path(options.local_dir).absolute()),
            "source_files": source_fingerprint(prepared.catalog),
            "dtype": options.dtype, "merge_ranks": group.world,
        }
        finish(stage, plan, prepared.hf_dir, options.torch_dtype, manifest, prepared.config_updates)

    on_rank_zero(group, setup, options.debug)
    sink = FileSink(stage, plan)
    progress = Progress(plan.total_bytes) if group.rank == 0 else None
    try:
        try:
            run_plan(plan, prepared.catalog, group, sink, progress, options.debug)
        finally:
            sink.close()
        group.barrier()
        on_rank_zero(group, complete, options.debug)
        verified = verify_staged(stage, prepared, group, options) if options.verify else None
        on_rank_zero(group, lambda: swap_into_place(stage, target, options.overwrite), options.debug)
    except BaseException:
        if group.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    if group.rank == 0:
        log.info("merger: wrote %s to %s in %.1fs (peak RSS rank 0: %s)", format_size(plan.total_bytes), target,
                 time.monotonic() - started, format_size(peak_rss_bytes()))
    return verified


def run_merge(options: MergeOptions, group: Group) -> Path:
    started = time.monotonic()
    target = Path(options.target_dir).absolute()
    prepared = prepare(options, group)
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
