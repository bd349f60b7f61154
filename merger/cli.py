"""The command line: `merger merge|test|lora|upload|inspect|watch|families`, a thin face of the library (merger/api): it parses
(flags.py), calls, prints, and turns the outcome into an exit code. The library, and torch with it, is imported
once the command line has parsed: `--version`, `--help` and a usage error answer without it.

Runs the same on one process and under torchrun/Slurm: the process group comes from the environment.
Errors reach the user as one line `merger: error: <what>, <which file>`, and end the process with their kind's exit
code (merger/errors.py, docs/api.md): 1 for errors of no other kind, 2 for a command line that does not parse, 130
when interrupted.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable, NoReturn

from .engine.torchrun_error import record_for_torchrun
from .errors import Interrupted, MergerError, UsageError, shared_exit_code, show_error_line
from .flags import build_parser, merge_options
from .io import scratch_folders
from .units import format_size

if TYPE_CHECKING:
    from .engine.source_check import SourceCheck


def _print_inspection(info: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if key == "output_files":
            print("output_files:")
            for f in value:
                print(f"  {f['name']}  {format_size(f['bytes'])}  {f['tensors']} tensors")
        elif key == "bytes_per_rank":
            print("bytes_per_rank:")
            for rank, moved in enumerate(value):
                print(f"  rank {rank}: " + ", ".join(f"{what.removesuffix('_bytes')} {format_size(n)}"
                                                      for what, n in moved.items()))
        elif key == "notes":
            for note in value:
                print(f"note: {note}")
        elif key == "skipped":
            _print_skipped(value)
        elif key.endswith("bytes"):
            print(f"{key}: {value} ({format_size(value)})")
        else:
            print(f"{key}: {value}")
    return 0


def _print_check(result: SourceCheck) -> int:
    """`inspect --check`: one error line per bad file, or one line saying what was checked (rank 0 prints)."""
    shown = os.environ.get("RANK", "0") == "0"
    for failure in result.bad.values():
        _fail(failure.line, show=shown)
    if not result.bad and shown:
        print(f"checked {result.files} source files, {result.bytes} bytes ({format_size(result.bytes)}) of tensor "
              f"data: all fine")
    return shared_exit_code([f.exit_code for f in result.bad.values()]) if result.bad else 0


def _print_skipped(skipped: dict[str, str]) -> None:
    """One line per rule: how many stored entries it left out, and the first of them (--json lists them all)."""
    by_rule: dict[str, list[str]] = {}
    for name, rule in skipped.items():
        by_rule.setdefault(rule, []).append(name)
    print(f"skipped: {len(skipped)} stored entries (--json lists each)")
    for rule, names in by_rule.items():
        print(f"  {rule}: {len(names)}, e.g. {names[0]}")


def _print_families(path) -> int:
    """`merger families`: the built-in families, or the one a family file gives; the records alone, not the
    library (the records' row kinds import torch, nothing else of a merge)."""
    from .mapping.family_file import read_family
    from .mapping.family_list import built_in, from_file

    print("\n".join(from_file(read_family(path)) if path else built_in()))
    return 0


def _printed(report: Callable[[], int]) -> int:
    """report(), which prints what it found to stdout. A reader that stopped reading (`merger inspect --json |
    head`) ends it quietly, as it ends `cat`: its exit status, and stdout pointed at /dev/null so that no later
    flush fails too."""
    try:
        return report()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def load_library() -> None:
    """Import merger's library (merger/api: the engine, and torch) the way a process of merger's own should: the
    `merger` command does before it runs a command that merges, and `launcher local` before it forks its ranks,
    so they start with it imported. Not for a process merger shares (main() in a caller's): it freezes every
    object the process holds."""
    # merger does no linear algebra: without this, numpy's OpenBLAS starts a thread per core that spins on its own
    # while torch imports (torchrun sets OMP_NUM_THREADS, which OpenBLAS also reads; a plain run does not).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # Importing torch makes a few hundred thousand long-lived objects, and the cyclic collector would walk them
    # over and over while they load (0.3-0.5 s of a 5 s merge on a 2-core machine). It stays off while merger
    # imports; then those objects move to the permanent generation, so later collections skip them.
    gc.disable()
    from . import api  # noqa: F401

    gc.freeze()
    gc.enable()


def _run(args: argparse.Namespace, own_process: bool) -> int:
    if args.command == "upload":
        from .output.publish import publish_folder

        print(publish_folder(args.target_dir.absolute(), args.hf_upload_path, args.private))
        return 0
    if args.command == "families":
        return _printed(lambda: _print_families(args.family))
    if own_process:
        load_library()
    # Imported here, not at the top: merger/api imports torch (2 s here), which parsing does not need.
    from .api import check_with, inspect_with, merge_with, verify_with
    from .watch import watch_with

    options = merge_options(vars(args))
    if args.command == "inspect" and args.check:
        return _printed(lambda: _print_check(check_with(options)))
    if args.command == "inspect":
        return _printed(lambda: _print_inspection(inspect_with(options, args.merge_ranks), args.json))
    if args.command == "test":
        return 0 if verify_with(options, args.test_hf_dir, args.atol, args.rtol).ok else 1
    if args.command == "watch":
        failed = watch_with(options, args.role, args.once, args.interval)  # returns only with --once
        if failed:
            _fail(f"{len(failed)} finished step{'s' * (len(failed) > 1)} could not be converted ({', '.join(failed)}; "
                  f"each one's error is above), {options.local_dir}")
        return shared_exit_code(list(failed.values())) if failed else 0
    merge_with(options)  # `lora`: options.adapters name the adapter folders to fold in
    return 0


def _terminated(signum, frame):
    # torchrun and Slurm stop a job with SIGTERM: unwind like Ctrl-C, so the staging folder is cleaned up.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _fail(message: str, code: int = 1, show: bool = True) -> int:
    """The `merger: error:` line on stderr (when this rank shows it) and, under torchrun, in its error record."""
    line = f"merger: error: {message}"
    if show:
        show_error_line(line)
    record_for_torchrun(line)
    return code


def command(argv: list[str] | None = None) -> NoReturn:
    """The `merger` command and `python -m merger`: main() in a process of merger's own (load_library), then the
    process ends without tearing down the interpreter. Freeing torch's modules and objects one by one at exit took
    0.4 s of every process on this project's 2-core VM (a process that only imports merger: 1.45 s, 1.07 s without
    the teardown), a second for each pair of ranks. By then main() has closed every file, the process group and
    its threads; what is left in Python's buffers is flushed here. In-process callers use main(), which returns."""
    code = main(argv, own_process=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone (`merger inspect ... | head`) or the stream closed
            pass
    scratch_folders.remove_all()  # their atexit handler never runs
    os._exit(code)


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run the command line `argv` (default: the process's) and return its exit status. `own_process` (command()):
    the process is merger's alone, so the library is imported as load_library imports it; in-process callers leave
    it off."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail(str(e), code=e.exit_code)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format="%(message)s", stream=sys.stderr)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        return _run(args, own_process)
    except MergerError as e:
        # An error every rank raised at a sync point is the same line on each: printed once, from rank 0.
        return _fail(str(e), code=e.exit_code, show=not e.agreed or os.environ.get("RANK", "0") == "0")
    except KeyboardInterrupt as e:
        rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        outcome = f"; {e.outcome}" if isinstance(e, Interrupted) else ""
        # Ctrl-C's KeyboardInterrupt has no args
        return _fail(f"interrupted by {str(e) or 'SIGINT'}{rank}{outcome}", code=Interrupted.exit_code)
    except Exception as e:  # noqa: BLE001 - a bug still gets one line unless --debug
        if args.debug:
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
