"""Slurm through submitit: one job, one task per merge rank. Each task turns Slurm's view of the job into
torch.distributed's environment (submitit's TorchDistributedEnvironment) and runs `merger.cli.main`.

The submitting process waits (unless --no-wait), prints the job's state as Slurm reports it, and on failure
prints the log tail of a failing task (with its `merger: error:` line) and returns that task's merger exit status
(its error's kind: docs/api.md), or 1 when the log does not say it. States come from
`scontrol show job` and, once Slurm has forgotten the job, `sacct`, so clusters without accounting work too.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from .paths import ROOT
from .pending import never_starts
from .rank_env import free_port

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "PREEMPTED"}
TAIL_LINES = 20
PORT_WAIT_S = 300  # how long the other tasks wait for rank 0 to say its port (it may start later on its node)
SUBMITIT_FAILURE_MARK = "Submitted job triggered an exception"


class MergeFailed(Exception):
    """Raised in a task whose merge failed, so submitit records an error and the task exits non-zero. Its message,
    in the task's log, is where the submitting process reads the merger's exit status (FAILED_STATUS)."""


FAILED_STATUS = re.compile(r"merger exited with status (\d+) on rank")


def master_port(job) -> int:
    """The port rank 0 hosts torch.distributed's store on: one free on rank 0's node when the job starts, which it
    writes into the job's folder (every node reads it: submitit's pickles are there) for the other tasks to read.
    submitit's own choice is drawn from the job id alone, so job 1 of every cluster takes the same port, whoever
    holds it then."""
    path = job.paths.folder / f"{job.job_id}_master_port"
    if job.global_rank == 0:
        port = free_port("0.0.0.0")
        written = path.with_name(path.name + ".tmp")
        written.write_text(str(port))
        os.replace(written, path)  # whole or not there: a task never reads half a number
        return port
    deadline = time.monotonic() + PORT_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise MergeFailed(f"rank 0 wrote no store port into {path} within {PORT_WAIT_S} s")
        time.sleep(0.05)
    return int(path.read_text())


def run_rank(merger_args: list[str], cwd: str) -> int:
    """Body of every Slurm task (pickled by submitit): join the group Slurm describes, run the merger."""
    import submitit

    os.chdir(cwd)  # relative paths in the merger's arguments mean what they meant where the user typed them
    os.environ["MASTER_PORT"] = str(master_port(submitit.JobEnvironment()))
    # LOCAL_RANK picks the GPU (torchrun's convention), so every task keeps all of its node's devices visible.
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    from merger.cli import main

    status = main(merger_args)
    if status:
        raise MergeFailed(f"merger exited with status {status} on rank {env.rank} of {env.world_size}")
    return status


def job_state(job_id: str) -> tuple[str, str | None]:
    """The job's state as Slurm reports it now (PENDING, RUNNING, COMPLETED, FAILED, ... or UNKNOWN) and, from
    `scontrol`, the reason Slurm gives for it (None when there is none, or only `sacct` still knows the job)."""
    queries = (["scontrol", "show", "job", "-o", job_id], ["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id])
    for cmd in queries:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if cmd[0] == "scontrol":
            found = re.search(r"JobState=(\S+)", out)
            reason = re.search(r"\bReason=(\S+)", out)
            if found:
                return found.group(1), (reason.group(1) if reason and reason.group(1) != "None" else None)
        elif found := re.match(r"\s*([A-Z_]+)", out):
            return found.group(1), None
    return "UNKNOWN", None


def wait_for(job, unknown_limit_s: float = 120) -> tuple[str, str | None]:
    """Wait until the job ends, or Slurm says it can never start; print each change of state or pending
    reason; return the last state and reason.

    Slurm is asked quickly at first, then every 10 s at most; between questions, the tasks' result files
    (submitit writes one per task as it ends) say when to ask again at once, so short jobs return promptly.
    """
    results = [job.task(t).paths.result_pickle for t in range(job.num_tasks)]
    last, interval, next_query, unknown_since = None, 0.5, 0.0, None
    while True:
        now = time.monotonic()
        if now >= next_query or all(p.exists() for p in results):
            state, reason = job_state(job.job_id)
            if (state, reason) != last:
                shown = f" ({reason.replace('_', ' ')})" if reason and state == "PENDING" else ""
                print(f"launcher: job {job.job_id} {state}{shown}", flush=True)
                last = (state, reason)
            if state not in ACTIVE and state != "UNKNOWN":
                return state, reason
            if state == "PENDING" and never_starts(reason):
                return state, reason
            unknown_since = (unknown_since or now) if state == "UNKNOWN" else None
            if unknown_since is not None and now - unknown_since > unknown_limit_s:
                return state, reason
            interval = min(interval * 1.5, 10.0)
            next_query = now + interval
        time.sleep(0.25)


def give_up(job, reason: str) -> None:
    """The job can never start: cancel it and say why, in Slurm's words and ours."""
    cancel = subprocess.run(["scancel", job.job_id], capture_output=True, text=True, timeout=60)
    done = ("cancelled it" if cancel.returncode == 0
            else f"scancel failed ({cancel.stderr.strip() or cancel.returncode}): scancel {job.job_id} by hand")
    print(f"launcher: error: job {job.job_id} can never start, Slurm says {reason}: {never_starts(reason)}; "
          f"{done}; change the request (--nodes, --mem, --time, --partition, --account)", file=sys.stderr)


def report_failure(job, state: str) -> int:
    """Print the log tail of the first task that wrote a `merger: error:` line (else of task 0); return the exit
    status its merger ended with (1 when its log does not say: a task that died before the merger returned)."""
    logs = [(task, task.stderr() or "") for task in (job.task(t) for t in range(job.num_tasks))]
    task, text = next(((t, s) for t, s in logs if "merger: error:" in s), logs[0])
    status = FAILED_STATUS.search(text)
    # What the merger said comes before submitit's traceback of MergeFailed, which says nothing more.
    lines = text.rstrip().splitlines()
    lines = lines[:next((i for i, line in enumerate(lines) if SUBMITIT_FAILURE_MARK in line), len(lines))]
    print(f"launcher: job {job.job_id} ended {state}; last lines of {task.paths.stderr}:", file=sys.stderr)
    for line in lines[-TAIL_LINES:]:
        print(line, file=sys.stderr)
    return int(status.group(1)) if status else 1


def make_executor(args: argparse.Namespace):
    import submitit

    executor = submitit.AutoExecutor(folder=args.folder, cluster="slurm")
    gpus = 0 if args.cpu else (args.gpus_per_node if args.gpus_per_node is not None else args.tasks_per_node)
    params = dict(name="merger", nodes=args.nodes, tasks_per_node=args.tasks_per_node, gpus_per_node=gpus,
                  cpus_per_task=args.cpus_per_task, timeout_min=args.time, slurm_partition=args.partition,
                  slurm_account=args.account, slurm_mem=args.mem,
                  # a task that fails ends the others at once, not when torch's store wait (10 minutes) runs out
                  slurm_srun_args=["--kill-on-bad-exit=1"],
                  # The job imports the same merger and launcher as this process, checkout or install.
                  slurm_setup=[f"export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"])
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def submit(args: argparse.Namespace, merger_args: list[str]) -> int:
    from submitit.core.utils import FailedJobError

    if not (shutil.which("sbatch") and shutil.which("srun")):
        print("launcher: error: sbatch/srun not found: run this where Slurm's commands are (a login node)",
              file=sys.stderr)
        return 1
    merger_args = merger_args + (["--device", "cpu"] if args.cpu else [])
    try:
        job = make_executor(args).submit(run_rank, merger_args, os.getcwd())
    except FailedJobError as e:  # sbatch refused the job; its error lines say why (the last one alone is vague)
        lines = str(e).strip().splitlines()
        said = [line.split("error:", 1)[1].strip() for line in lines if "sbatch: error:" in line] or lines[-1:]
        print(f"launcher: error: could not submit the Slurm job: {'; '.join(said)}", file=sys.stderr)
        return 1
    ranks = args.nodes * args.tasks_per_node
    print(f"launcher: submitted job {job.job_id}: {ranks} ranks on {args.nodes} node(s); logs in {job.paths.folder}",
          flush=True)
    if args.no_wait:
        return 0
    try:
        state, reason = wait_for(job)
    except KeyboardInterrupt:
        print(f"launcher: stopped waiting; job {job.job_id} goes on (scancel {job.job_id} stops it)", file=sys.stderr)
        return 130
    if state == "COMPLETED":
        return 0
    if state == "PENDING":  # wait_for stops on a pending job only when it can never start
        give_up(job, reason)
        return 1
    return report_failure(job, state)
