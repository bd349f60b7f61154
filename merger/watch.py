"""`merger watch`: each finished checkpoint of a training run, converted into an HF folder of its own, once.

A run folder holds one folder per saved step, and each trainer says in its own way when a step is complete:
- verl: `global_step_N/actor` (or `critic/`), once `latest_checkpointed_iteration.txt` names N or more;
- HF Trainer and TRL: `checkpoint-N`, once its `trainer_state.json` is written (the Trainer's last file);
- Megatron-LM: `iter_NNNNNNN`, up to the step `latest_checkpointed_iteration.txt` names;
- torchtitan (DCP): `step-N`, once its `.metadata` is written (dcp.save's last file).
Step N goes to `TARGET/<its folder's name>`. A step whose output holds a complete merge (its manifest says so)
is skipped without reading it, so a restarted watcher picks up where it was; a merge cut short is resumed from
its kept staging folder (`--resume`'s checksums decide what is reused). A step that fails is reported in one
line and retried on the next pass; the steps after it go on. A step whose target lock a live process holds (another
watcher on the same run) is left to it and said once, neither failed nor retried; so is a step deleted before or
while it is converted (a trainer that keeps its last K checkpoints), whose partial merge is removed.

Under torchrun every rank takes part in every merge: rank 0 lists the steps and the others follow its list, so
the ranks never disagree on what is finished.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .api import joined_group, one_intra_op_thread
from .api.pipeline import run_merge
from .engine.dist import Group
from .errors import MergerError, SourceError
from .io import is_remote
from .options import MergeOptions
from .output.target_folder import earlier_merge, lock_of, stage_of
from .output.target_lock import TargetLock
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


STEP_FOLDER = re.compile(r"(global_step_|iter_|checkpoint-|step-)(\d+)")


def _tracked(tracked: int | None, n: int) -> str | None:
    """Why step `n` of a run whose tracker names `tracked` is not finished yet (None: it is)."""
    if tracked is None:
        return f"no {TRACKER} yet"
    return None if tracked >= n else f"{TRACKER} says {tracked}"


def scan(run: Path, role: str) -> tuple[list[Step], dict[str, str]]:
    """The run's steps whose save is complete, in step order, and each other step folder's name with why it is not
    complete yet."""
    tracked = _tracked_step(run)
    steps, waiting = [], {}
    for folder in sorted(run.iterdir()) if run.is_dir() else ():
        m = STEP_FOLDER.fullmatch(folder.name)
        if not folder.is_dir() or m is None:
            continue
        kind, n = m.group(1), int(m.group(2))
        source = folder / role if kind == "global_step_" else folder
        if kind in ("global_step_", "iter_"):
            why = _tracked(tracked, n) or (None if source.is_dir() else f"no {role}/ folder in it")
        elif kind == "checkpoint-":
            why = None if (folder / "trainer_state.json").is_file() else "no trainer_state.json yet, the Trainer's " \
                                                                           "last file"
        else:
            why = None if (folder / ".metadata").is_file() else "no .metadata yet, dcp.save's last file"
        if why is None:
            steps.append(Step(n, folder.name, source))
        else:
            waiting[folder.name] = why
    return sorted(steps, key=lambda s: s.number), waiting


def finished_steps(run: Path, role: str) -> list[Step]:
    """The run's steps whose save is complete, in step order."""
    return scan(run, role)[0]


# files that make a folder a checkpoint (verl FSDP rank files, DCP, Megatron, safetensors), not a run of them
CHECKPOINT_FILES = ("model_world_size_*_rank_*.pt", "*.distcp", ".metadata", "mp_rank_*", "*.safetensors")


def not_a_run(run: Path) -> str | None:
    """Why `run` is a part of a run or a checkpoint rather than the folder a trainer saves its steps into, with
    what to give instead; None when it may be a run (its steps, or none yet)."""
    if STEP_FOLDER.fullmatch(run.name):
        return f"this is one saved step, not the run: watch the run folder {run.parent}, or merge the step with " \
               f"merger merge"
    if STEP_FOLDER.fullmatch(run.parent.name):
        return f"this is the {run.name}/ folder of one saved step: watch the run folder {run.parent.parent}"
    if not any(STEP_FOLDER.fullmatch(p.name) for p in run.iterdir()) and \
            any(next(run.glob(pattern), None) for pattern in CHECKPOINT_FILES):
        return "this folder holds a checkpoint, not a run's saved steps: merge it with merger merge"
    return None


def converted(target: Path) -> bool:
    """`target` holds a merge that finished (its manifest says so): the step is done, and nothing is read."""
    manifest = earlier_merge(target)
    return manifest is not None and manifest.complete is True


@dataclass(frozen=True)
class _Look:
    """What rank 0 finds of a step before (and after) merging it. Looked at in this order, each before the next: a
    merge takes the lock before it stages and renames its output into place before it lets go, so a staging folder
    seen while the lock was free after it is no live merge's, and a step found unconverted after a free lock was not
    finished by whoever held it."""
    stage: bool  # a staging folder is left to resume
    holder: dict | None  # the lock record of another process converting the step now ({}: unreadable); None: none
    converted: bool
    source: bool  # the step is still there: a trainer that keeps the last K checkpoints deletes older ones

    @classmethod
    def of(cls, step: Step, target: Path, group: Group) -> _Look:
        """Rank 0's look, on every rank."""
        if group.rank != 0:
            return group.all_gather(None)[0]
        stage = stage_of(target).exists()
        holder = TargetLock(lock_of(target), target).live_holder()
        return group.all_gather(cls(stage, holder, converted(target), step.source.is_dir()))[0]


def _busy(name: str, holder: dict) -> str:
    who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "its lock record is unreadable"
    return f"merger: watch: {name} is being converted by another process ({who}), skipping it"


ROTATED = "(rotated away by the trainer: max_actor_ckpt_to_keep, save_total_limit, ...)"


def convert_pending(options: MergeOptions, role: str, group: Group,
                    told: set[str]) -> tuple[list[str], dict[str, str], int]:
    """One pass: merge every finished step not converted yet, in step order, but for those another process is
    converting (its lock on the step's target says so) and those deleted meanwhile; each said once (`told`: what
    this watcher said already). Returns those that failed (name: the exit code of the error that stopped it), the step
    folders still being saved (name: why), and how many steps are converted already."""
    run, out = Path(options.local_dir), Path(options.target_dir)
    steps, waiting = group.all_gather(scan(run, role) if group.rank == 0 else None)[0]
    failed: dict[str, int] = {}
    done = 0

    def say_once(line: str) -> None:
        if group.rank == 0 and line not in told:
            told.add(line)
            log.info(line)

    for step in steps:
        target = out / step.name
        look = _Look.of(step, target, group)
        if look.converted:
            done += 1
            continue
        if look.holder is not None:
            say_once(_busy(step.name, look.holder))
            continue
        if not look.source:
            say_once(f"merger: watch: {step.name} was deleted before its turn {ROTATED}, skipping it")
            continue
        # An attempt cut short (a failure, a killed watcher) kept its staging folder: its finished files are reused.
        step_options = dataclasses.replace(options, local_dir=step.source, target_dir=target, keep_partial=True,
                                           resume=look.stage)
        try:
            summary = run_merge(step_options, group)
        except MergerError as e:
            # What stopped it: another watcher that took the step since the look above, the step deleted, or itself.
            look = _Look.of(step, target, group)
            if look.converted:
                done += 1
            elif look.holder is not None:
                say_once(_busy(step.name, look.holder))
            elif not look.source:
                kept = options.keep_partial or options.resume
                if group.rank == 0 and not kept:
                    shutil.rmtree(stage_of(target), ignore_errors=True)
                say_once(f"merger: watch: {step.name} was deleted while it was being converted {ROTATED}; its "
                         f"partial merge was {f'kept in {stage_of(target)}' if kept else 'removed'}, skipping it")
            else:
                failed[step.name] = e.exit_code
                if group.rank == 0:
                    log.warning("merger: watch: %s failed, retried on the next pass: %s", step.name, e)
            continue
        done += 1
        if group.rank == 0:
            log.info("merger: watch: %s -> %s (%s in %.1f s)", step.source, target, format_size(summary["bytes"]),
                     summary["wall_time_s"])
    return failed, waiting, done


def _say_waiting(run: Path, waiting: dict[str, str], done: int) -> None:
    """What the watcher waits for: each step folder not finished and why, or that it has none to wait for."""
    if waiting:
        log.info("merger: watch: waiting for %s", "; ".join(f"{name}: {why}" for name, why in waiting.items()))
    else:
        log.info("merger: watch: %s step%s converted, none being saved in %s (its step folders: verl global_step_N, "
                 "HF Trainer checkpoint-N, Megatron-LM iter_N, torchtitan step-N)", done, "" if done == 1 else "s",
                 run)


def watch(options: MergeOptions, role: str, once: bool, interval: float, group: Group) -> dict[str, int]:
    """Convert the run's finished steps now, then (unless `once`) again every `interval` seconds, until stopped;
    with `once`, the steps whose conversion failed, each with its error's exit code. What it waits for is said at
    the start and when it changes."""
    if group.rank == 0:
        log.info("merger: watch: %s, every step whose save is complete (verl global_step_N/%s, HF Trainer "
                 "checkpoint-N, Megatron-LM iter_N, torchtitan step-N) -> %s/<step>%s", options.local_dir, role,
                 options.target_dir, "" if once else f", looking again every {interval:g} s (Ctrl-C stops)")
    if is_remote(options.local_dir):
        raise MergerError(f"merger watch reads a run folder on a local or mounted filesystem, where it learns that a "
                          f"save completed; merge each step from the bucket with merger merge, {options.local_dir}")
    run = Path(options.local_dir)
    if not run.is_dir():
        raise SourceError(f"run folder does not exist, {options.local_dir}")
    if (why := not_a_run(run)) is not None:
        raise SourceError(f"{why}, {options.local_dir}")
    said, told = None, set()
    while True:
        failed, waiting, done = convert_pending(options, role, group, told)
        if group.rank == 0 and (waiting, done) != said:
            _say_waiting(run, waiting, done)
            said = (waiting, done)
        if once:
            return failed
        time.sleep(interval)


def watch_with(options: MergeOptions, role: str, once: bool, interval: float) -> dict[str, int]:
    """`merger watch` over one group for all its merges, joined as the library joins one (merger/api); with `once`,
    the steps that failed, each with its error's exit code."""
    with one_intra_op_thread(), joined_group(options) as joined:
        return watch(options, role, once, interval, joined)
