"""The merge operation: catalog, plan, stream into a staging folder, finish, rename. Runs on every rank.

Each phase ends at a sync point where every rank learns whether any rank failed, so an error on one rank
stops all of them with the same message and no rank is left waiting in a collective.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import __version__
from .catalog import Catalog
from .dist import Group
from .errors import MergerError, describe_error
from .mapping import build_steps, config_updates, read_config
from .memory import peak_rss_bytes
from .options import MergeOptions
from .output import FileSink, check_target, finish, prepare_files, staging_dir
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
        steps = build_steps(catalog, config, options)
        plan = plan_layout(catalog, steps, group.world, options.max_shard_size, options.max_inflight)
        return Prepared(catalog, hf_dir, config, plan)

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


def run_merge(options: MergeOptions, group: Group) -> Path:
    started = time.monotonic()
    target = Path(options.target_dir).absolute()
    stage = staging_dir(target)
    prepared = prepare(options, group)
    plan = prepared.plan

    def setup():
        check_target(target, options.overwrite)
        prepare_files(stage, plan)

    on_rank_zero(group, setup, options.debug)
    sink = FileSink(stage, plan)
    progress = Progress(plan.total_bytes) if group.rank == 0 else None
    try:
        try:
            run_plan(plan, prepared.catalog, group, sink, progress, options.debug)
        finally:
            sink.close()
        group.barrier()

        def complete():
            manifest = {
                "merger_version": __version__, "source_format": prepared.catalog.format,
                "source_dir": str(Path(options.local_dir).absolute()),
                "source_files": source_fingerprint(prepared.catalog),
                "dtype": options.dtype, "merge_ranks": group.world,
            }
            finish(stage, target, plan, prepared.hf_dir, options.torch_dtype, manifest, options.overwrite,
                   config_updates(prepared.config, options))

        on_rank_zero(group, complete, options.debug)
    except BaseException:
        if group.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    if group.rank == 0:
        log.info("merger: wrote %s to %s in %.1fs (peak RSS rank 0: %s)", format_size(plan.total_bytes), target,
                 time.monotonic() - started, format_size(peak_rss_bytes()))
    return target
