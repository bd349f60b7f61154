"""Which reasons Slurm gives for a PENDING job mean that it can never start as submitted.

Taken from Slurm's job reason codes (squeue(1) "JOB REASON CODES", slurm.schedmd.com/job_reason_codes.html)
and checked on slurm-wlm 22.05: each of these comes from comparing the request with the configured limits of
its partition, QOS or association (or, for BadConstraints, slurmctld finding it non-runnable and setting its
priority to 0), not with what is busy or down right now. Waiting does not help; a changed request, or an
administrator changing the limits, does.

Kept out on purpose, because they clear by themselves: Resources, Priority, Dependency, BeginTime,
ReqNodeNotAvail (nodes DOWN or DRAINED come back), NodeDown, PartitionDown/Inactive, the aggregate (Grp*)
and job-count (AssocMaxJobsLimit, QOSMaxJobsPerUserLimit, ...) limits, JobHeld*. The launcher keeps waiting
on those and shows them.
"""
from __future__ import annotations

import re

NEVER = {
    "PartitionConfig": "the request does not fit the partition's nodes or configuration (CPUs, memory, GPUs or "
                       "node count)",
    "PartitionNodeLimit": "the number of nodes is outside the partition's limits",
    "PartitionTimeLimit": "--time exceeds the partition's time limit",
    "MaxMemPerLimit": "--mem exceeds the partition's memory limit per node or per CPU",
    "BadConstraints": "Slurm found the request non-runnable",
    "InvalidAccount": "the job's account is invalid",
    "InvalidQOS": "the job's QOS is invalid",
}
# A per-job or per-node maximum of the association or QOS (QOSMaxWallDurationPerJobLimit, AssocMaxCpuPerJobLimit,
# QOSMaxGRESPerNode, ...): one job's request exceeds it. Counts of jobs per user or account are not matched.
PER_JOB_LIMIT = re.compile(r"^(Assoc|QOS)Max\w*Per(Job|Node)")


def never_starts(reason: str | None) -> str | None:
    """What a pending reason that can never clear means, or None when waiting may help."""
    if not reason:
        return None
    if reason in NEVER:
        return NEVER[reason]
    if PER_JOB_LIMIT.match(reason):
        return "the request exceeds a per-job limit of its association or QOS"
    return None
