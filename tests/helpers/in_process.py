"""merger's CLI called in the test's own process: no interpreter start-up per merge (about 2 s of CPU each on the
2-core CI machine, most of it `import torch`). For tests whose point is the output; a test whose point is the exit
code, a signal, stderr or the process itself starts merger as a process (tests/helpers/processes.py)."""
from __future__ import annotations

from pathlib import Path


def run_in_process(*args) -> None:
    """`merger ARGS` (any command: merge, lora, inspect, test) in this process; it must succeed."""
    from merger.cli import main

    argv = [str(arg) for arg in args]
    assert main(argv) == 0, f"merger {' '.join(argv)} failed in process"


def merge_in_process(source: Path, target: Path, *extra) -> Path:
    """One merge in this process (the CLI's own entry point)."""
    run_in_process("merge", "--local_dir", source, "--target_dir", target, *extra)
    return target


def merge_here(capsys, *args) -> tuple[int, list[str]]:
    """Run `merger merge ARGS` in this process; returns the exit code and the `merger: error:` lines."""
    from merger.cli import main

    code = main(["merge", *map(str, args)])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("merger: error:")]


def single_error_line(stderr: str) -> str:
    """The one `merger: error:` line of a run's stderr (there must be exactly one)."""
    errors = [line for line in stderr.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1, stderr
    return errors[0]
