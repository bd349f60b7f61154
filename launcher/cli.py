"""Command line of the launcher: its own options before `--`, the merger's command line after it."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

USAGE_TAIL = "put the merger's arguments after `--`, e.g. `-- merge --local_dir CKPT --target_dir OUT`"
LOGS = "merger_slurm_logs"
MERGER_COMMANDS = ("merge", "test", "lora", "upload", "inspect")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launcher", description=__doc__, epilog=USAGE_TAIL)
    sub = parser.add_subparsers(dest="mode", required=True)

    slurm = sub.add_parser("slurm", help="submit one Slurm job with one task per rank (submitit)",
                           epilog=USAGE_TAIL)
    slurm.add_argument("--nodes", type=int, default=1)
    slurm.add_argument("--tasks-per-node", type=int, default=1, help="merge ranks per node")
    slurm.add_argument("--gpus-per-node", type=int, default=None,
                       help="GPUs to ask for per node (default: one per task; none with --cpu)")
    slurm.add_argument("--cpus-per-task", type=int, default=None)
    slurm.add_argument("--mem", default=None, help="memory per node as sbatch spells it: 64G, 500M, 0 = all")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--time", type=int, default=120, help="time limit in minutes (default 120)")
    slurm.add_argument("--cpu", action="store_true",
                       help="no GPUs: ranks talk over gloo (the merger runs with --device cpu)")
    slurm.add_argument("--folder", type=Path, default=None,
                       help=f"submitit's folder for the job's pickles and logs; %%j is the job id (default "
                            f"{LOGS}/%%j beside the target folder, else in the current folder); must be on a "
                            f"filesystem the nodes share")
    slurm.add_argument("--no-wait", action="store_true", help="print the job id and log folder and return")

    local = sub.add_parser("local", help="run N ranks on this machine as a gloo group (no torchrun needed)",
                           epilog=USAGE_TAIL)
    local.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")

    ray = sub.add_parser("ray", help="run N ranks as Ray actors, one per placement-group bundle, spread over the "
                                     "cluster's nodes (pip install 'merger[ray]')", epilog=USAGE_TAIL)
    ray.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    ray.add_argument("--gpus-per-rank", type=int, default=0,
                     help="GPUs in each rank's bundle; with any, ranks talk over NCCL and the merger runs with "
                          "--device cuda (default 0: gloo, --device cpu)")
    ray.add_argument("--cpus-per-rank", type=float, default=1, help="CPUs in each rank's bundle (default 1)")
    ray.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                     help="the Ray cluster to join (default $RAY_ADDRESS; without it, start a local cluster "
                          "that ends with the launcher)")
    return parser


def default_folder(merger_args: list[str]) -> Path:
    """LOGS/%j in the target's parent folder (a place the nodes share, since they write the target there), not
    in whatever folder the launcher was started from; the current folder when the command has no target."""
    for i, arg in enumerate(merger_args):
        flag, eq, value = arg.partition("=")
        if flag in ("--target_dir", "--target-dir"):
            target = value if eq else (merger_args[i + 1] if i + 1 < len(merger_args) else None)
            if target:
                return Path(target).absolute().parent / LOGS / "%j"
    return Path(LOGS) / "%j"


def _missing_separator(argv: list[str]) -> str | None:
    """The command line with `--` put before the merger's command, when the user left it out."""
    if "--" in argv:
        return None
    at = next((i for i, arg in enumerate(argv) if arg in MERGER_COMMANDS), None)
    return None if at is None else shlex.join(["launcher", *argv[:at], "--", *argv[at:]])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if (fixed := _missing_separator(argv)) is not None:
        parser.error(f"put `--` before the merger's arguments: python -m {fixed}")
    cut = argv.index("--") if "--" in argv else len(argv)
    args, merger_args = parser.parse_args(argv[:cut]), argv[cut + 1:]  # parsed first, so --help works
    if not merger_args:
        parser.error(USAGE_TAIL)
    if args.mode == "local":
        from .local import run_local

        return run_local(args.nproc, merger_args)
    if args.mode == "ray":
        from .ray import run_ray

        return run_ray(args.nproc, args.gpus_per_rank, args.cpus_per_rank, args.address, merger_args)
    from .slurm import submit

    if args.folder is None:
        args.folder = default_folder(merger_args)
    return submit(args, merger_args)
