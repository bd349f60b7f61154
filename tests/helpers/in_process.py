"""merger's CLI called in the test's own process: no interpreter start-up per merge."""
from __future__ import annotations

from pathlib import Path


def merge_in_process(source: Path, target: Path, *extra) -> Path:
    """One merge in this process (the CLI's own entry point)."""
    from merger.cli import main

    assert main(["merge", "--local_dir", str(source), "--target_dir", str(target), *map(str, extra)]) == 0
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
