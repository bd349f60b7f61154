"""`merger watch`: each finished checkpoint of a training run, converted into an HF folder of its own, once.

A run folder holds one folder per saved step, and each trainer says in its own way when a step is complete:
- verl: `global_step_N/actor` (or `critic/`), once `latest_checkpointed_iteration.txt` names N or more;
- HF Trainer and TRL: `checkpoint-N`, once its `trainer_state.json` is written (the Trainer's last file);
- Megatron-LM: `iter_NNNNNNN`, up to the step `latest_checkpointed_iteration.txt` names;
- torchtitan (DCP): `step-N`, once its `.metadata` is written (dcp.save's last file).
Step N goes to `TARGET/<its folder's name>`. A step whose output holds a complete merge (its manifest says so)
is skipped without reading it, so a restarted watcher picks up where it was; a merge cut short is resumed from
its kept staging folder (`--resume`'s checksums decide what is reused). A step that fails is reported in one
line and retried on the next pass; the steps after it go on.

Under torchrun every rank takes part in every merge: rank 0 lists the steps and the others follow its list, so
the ranks never disagree on what is finished.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .api.pipeline import run_merge
from .engine.dist import Group
from .errors import MergerError
from .io import is_remote
from .options import MergeOptions
from .output.target import earlier_merge, stage_of
from .sources.megatron_layout import TRACKER
from .units import format_size

log = logging.getLogger("merger")


@dataclass(frozen=True)
class Step:
    number: int
    name: str  # the step folder's name, which its output folder takes too
    source: Path  # what is merged: the step folder, or its role folder (verl)


def _tracked_step(run: Path) -> int | None:
    """The last step the trainer finished saving, as verl and Megatron-LM record it; None before the first (or
    Megatron's `release`)."""
    try:
        return int((run / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def finished_steps(run: Path, role: str) -> list[Step]:
    """The run's steps whose save is complete, in step order."""
    tracked = _tracked_step(run)
    steps = []
    for folder in run.iterdir() if run.is_dir() else ():
        if not folder.is_dir():
            continue
        if m := re.fullmatch(r"global_step_(\d+)", folder.name):
            done, source = tracked is not None and tracked >= int(m.group(1)), folder / role
        elif m := re.fullmatch(r"iter_(\d+)", folder.name):
            done, source = tracked is not None and tracked >= int(m.group(1)), folder
        elif m := re.fullmatch(r"checkpoint-(\d+)", folder.name):
            done, source = (folder / "trainer_state.json").is_file(), folder
        elif m := re.fullmatch(r"step-(\d+)", folder.name):
            done, source = (folder / ".metadata").is_file(), folder
        else:
            continue
        if done and source.is_dir():
            steps.append(Step(int(m.group(1)), folder.name, source))
    return sorted(steps, key=lambda s: s.number)


def converted(target: Path) -> bool:
    """`target` holds a merge that finished (its manifest says so): the step is done, and nothing is read."""
    manifest = earlier_merge(target)
    return manifest is not None and manifest.complete is True


def convert_pending(options: MergeOptions, role: str, group: Group) -> list[str]:
    """One pass: merge every finished step not converted yet, in step order; the names of those that failed."""
    run, out = Path(options.local_dir), Path(options.target_dir)
    steps = group.all_gather(finished_steps(run, role) if group.rank == 0 else None)[0]
    failed = []
    for step in steps:
        target = out / step.name
        if converted(target):
            continue
        # An attempt cut short (a failure, a killed watcher) kept its staging folder: its finished files are reused.
        step_options = dataclasses.replace(options, local_dir=step.source, target_dir=target, keep_partial=True,
                                           resume=stage_of(target).exists())
        try:
            summary = run_merge(step_options, group)
        except MergerError as e:
            failed.append(step.name)
            if group.rank == 0:
                log.warning("merger: watch: %s failed, retried on the next pass: %s", step.name, e)
            continue
        if group.rank == 0:
            log.info("merger: watch: %s -> %s (%s in %.1f s)", step.source, target, format_size(summary["bytes"]),
                     summary["wall_time_s"])
    return failed


def watch(options: MergeOptions, role: str, once: bool, interval: float, group: Group) -> list[str]:
    """Convert the run's finished steps now, then (unless `once`) again every `interval` seconds, until stopped;
    with `once`, the steps whose conversion failed."""
    if group.rank == 0:
        log.info("merger: watch: %s, every step whose save is complete (verl global_step_N/%s, HF Trainer "
                 "checkpoint-N, Megatron-LM iter_N, torchtitan step-N) -> %s/<step>%s", options.local_dir, role,
                 options.target_dir, "" if once else f", looking again every {interval:g} s (Ctrl-C stops)")
    if is_remote(options.local_dir):
        raise MergerError(f"merger watch reads a run folder on a local or mounted filesystem, where it learns that a "
                          f"save completed; merge each step from the bucket with merger merge, {options.local_dir}")
    if not Path(options.local_dir).is_dir():
        raise MergerError(f"run folder does not exist, {options.local_dir}")
    while True:
        failed = convert_pending(options, role, group)
        if once:
            return failed
        time.sleep(interval)
