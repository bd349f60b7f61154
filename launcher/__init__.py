"""Start merger processes: a Slurm job through submitit (`launcher.slurm`), a local gloo group
(`launcher.local`) or actors on a Ray cluster (`launcher.ray`). The launcher only starts processes and sets up torch.distributed's environment; every
rank runs the same `merger.cli.main` as `python -m merger`, which knows the formats."""
