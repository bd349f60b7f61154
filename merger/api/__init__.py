"""merger as a library: `merge`, `inspect` and `verify`, in-process, on one process or on every rank of a group.

The command line is a thin face of these functions. Options are keyword arguments with the CLI's names
(`dtype="bf16"`, `max_shard_size="2GB"`, `overwrite=True`), each checked by its flag's own conversion and choices
(merger/flags.py keyword_values), with no command line made or parsed.
Bad input raises MergerError (the subclass of its kind: errors.py) with the CLI's one-line message; nothing exits
the caller's process, and no logging, signal handler, process group or torch thread setting is left changed after
a call.

Groups: under torchrun (or Slurm, or `launcher local`) with no process group started yet, a call joins the one
the environment describes and leaves it at the end, as the CLI does. Inside a training script whose default
group exists already, it merges over that group (or the `group=` given) and leaves it as it found it: every rank
of that group calls the function.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from ..engine.compare import CompareResult, compare_with_folder
from ..engine.dist import Group, borrow_group, init_group
from ..engine.plan import traffic
from ..engine.source_check import SourceCheck, check_sources
from ..errors import MergerError
from ..flags import keyword_values, merge_options
from ..io.fetched import origin
from ..output.summary import output_files
from .pipeline import prepare, run_merge
from ..options import MergeOptions

__all__ = ["MergerError", "inspect", "merge", "verify"]


def merge(local_dir: str | os.PathLike, target_dir: str | os.PathLike, *, group=None, **options) -> dict:
    """Merge the checkpoint at `local_dir` into a HF model folder at `target_dir`; return what `--summary_json`
    holds (status, files, bytes, time, peak memory per rank, verify result), on every rank.

    `options`: any `merger merge` flag by name, e.g. `dtype="bfloat16"`, `hf_model_config_path=...`,
    `verify=True`. `group`: a torch.distributed ProcessGroup to merge over (default: the default group, when one
    exists)."""
    return merge_with(_checked("merge", local_dir=local_dir, target_dir=target_dir, **options)[0], group)


def inspect(local_dir: str | os.PathLike, *, merge_ranks: int = 1, **options) -> dict:
    """Describe the checkpoint and the planned output, reading no tensor data: format, files, tensors, the output
    files and what each of `merge_ranks` ranks would read, exchange and write (as `merger inspect --json`)."""
    checked, values = _checked("inspect", local_dir=local_dir, merge_ranks=merge_ranks, **options)
    return inspect_with(checked, values["merge_ranks"])


def verify(local_dir: str | os.PathLike, test_hf_dir: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
           group=None, **options) -> dict:
    """Merge in memory and compare every tensor with the HF folder `test_hf_dir` (a reference model, or the
    output of an earlier merge), in that folder's dtypes; `ok` says whether all matched within atol/rtol."""
    checked, values = _checked("test", local_dir=local_dir, test_hf_dir=test_hf_dir, atol=atol, rtol=rtol, **options)
    return verify_with(checked, values["test_hf_dir"], values["atol"], values["rtol"], group).as_dict()


def _checked(command: str, **keywords) -> tuple[MergeOptions, dict]:
    """The options of `command` given as keywords, checked as its flags are: MergeOptions, and every value by name
    (those of the command's other flags too: `merge_ranks`, `atol`)."""
    values = keyword_values(command, keywords)
    return merge_options(values), values


def merge_with(options: MergeOptions, group=None) -> dict:
    """`merge` (and `lora`, whose adapters are in options.adapters) with options parsed already."""
    with one_intra_op_thread(), joined_group(options, group) as joined:
        return run_merge(options, joined)


def verify_with(options: MergeOptions, test_hf_dir: Path, atol: float, rtol: float, group=None) -> CompareResult:
    options = dataclasses.replace(options, dtype="keep")  # each tensor is compared in the reference's own dtype
    with one_intra_op_thread(), joined_group(options, group) as joined:
        prepared = prepare(options, joined)
        return compare_with_folder(prepared.plan, prepared.catalog, joined, test_hf_dir, atol=atol, rtol=rtol,
                                   debug=options.debug)


def check_with(options: MergeOptions) -> SourceCheck:
    """`inspect --check`: every source byte a merge would read that the format checksums, read and checked, on
    every rank of the group (control messages only: gloo)."""
    options = dataclasses.replace(options, device="cpu")
    with joined_group(options) as joined:
        return check_sources(prepare(options, joined, check_sizes=False).catalog, joined, options.debug)


def inspect_with(options: MergeOptions, merge_ranks: int) -> dict:
    prepared = prepare(options, Group(), merge_ranks)  # one process plans for all: the plan is the same on every rank
    c, plan = prepared.catalog, prepared.plan
    info = {
        "format": c.format, "root": str(c.root), "source_files": len(c.files), **c.details,
        "tensors": len(c.tensors), "source_bytes": c.nbytes, "hf_dir": str(origin(prepared.hf_dir)),
        "output_dtype": options.dtype, "output_tensors": len(plan.location), "output_bytes": plan.total_bytes,
        "output_files": output_files(plan),
        "merge_ranks": merge_ranks, "bytes_per_rank": traffic(plan),
        "notes": [note.removeprefix("merger: ") for note in prepared.notes],  # what the mapping found and does
    }
    if c.skipped:  # formats that name their skip rules (Megatron): stored name -> rule
        info["skipped"] = c.skipped
    return info


@contextlib.contextmanager
def joined_group(options: MergeOptions, process_group=None):
    """The group to merge over: the caller's (`process_group`, or a default group that exists), left as found;
    else the one torchrun/Slurm describe in the environment (or none: one process), left at the end."""
    import torch.distributed as dist

    borrowed = process_group is not None or (dist.is_available() and dist.is_initialized())
    group = borrow_group(process_group) if borrowed else init_group(options.device, options.dist_timeout)
    try:
        yield group
    except KeyboardInterrupt as e:
        if str(e) == "SIGTERM":  # under torchrun: its agent stops the others when a rank dies; say which died
            group.explain_interrupt()
        raise
    finally:
        group.close()


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op pool off while merging, unless OMP_NUM_THREADS asks otherwise (torchrun sets it to 1).

    The merge keeps the cores busy with threads of its own (reading and casting, writing, hashing). A cast
    split over torch's pool on top of them waits for workers those threads keep off the cores: a 1-process
    merge on 2 cores ran 2-3x slower with the pool than without."""
    import torch

    previous = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)  # the caller (a training script, a notebook) gets its pool back
