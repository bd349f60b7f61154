"""merger's CLI called in the test's own process: no interpreter start-up per merge (about 2 s of CPU each on the
2-core CI machine, most of it `import torch`). For tests whose point is the output; a test whose point is the exit
code, a signal, stderr or the process itself starts merger as a process (tests/helpers/processes.py)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def run_in_process(*args, env: dict | None = None) -> None:
    """`merger ARGS` (any command: merge, lora, inspect, test) in this process, with the variables of `env` set
    for its length (an object store's endpoint and keys); it must succeed."""
    from merger.cli import main

    argv = [str(arg) for arg in args]
    with environment(env or {}):
        assert main(argv) == 0, f"merger {' '.join(argv)} failed in process"


def stdout_in_process(capsys, *args, env: dict | None = None) -> str:
    """What `merger ARGS` (inspect, say) prints on stdout, run as run_in_process runs it."""
    capsys.readouterr()
    run_in_process(*args, env=env)
    return capsys.readouterr().out


@contextmanager
def environment(variables: dict):
    """os.environ with `variables` set, as it was again afterwards."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def merge_in_process(source: Path, target: Path, *extra) -> Path:
    """One merge in this process (the CLI's own entry point)."""
    run_in_process("merge", "--local_dir", source, "--target_dir", target, *extra)
    return target


def command_here(capsys, *args) -> tuple[int, list[str]]:
    """Run `merger ARGS` (any command) in this process; returns the exit code and the `merger: error:` lines."""
    from merger.cli import main

    code = main([str(arg) for arg in args])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("merger: error:")]


def merge_here(capsys, *args) -> tuple[int, list[str]]:
    """Run `merger merge ARGS` in this process; returns the exit code and the `merger: error:` lines."""
    return command_here(capsys, "merge", *args)


def refused_here(capsys, target: Path, *args) -> list[str]:
    """Run `merger merge --target_dir TARGET ARGS` in this process, which must fail and leave nothing at TARGET;
    returns the `merger: error:` lines."""
    code, errors = merge_here(capsys, "--target_dir", target, *args)
    assert code != 0
    assert not target.exists()
    return errors


def single_error_line(stderr: str) -> str:
    """The one `merger: error:` line of a run's stderr (there must be exactly one)."""
    errors = [line for line in stderr.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1, stderr
    return errors[0]
