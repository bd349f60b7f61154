"""The one exception type that reaches users as a single `merger: error: ...` line."""
import sys
import traceback


class MergerError(Exception):
    """A problem with the user's input or environment, not a bug in merger.

    The CLI prints it as one line (no traceback unless --debug) and exits non-zero.
    Messages say what is wrong and name the file involved: `<what>, <which file>`.
    """


class UsageError(MergerError):
    """A command line, or the API's keyword options, that do not parse: exit code 2 in the CLI."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a SIGTERM) that stopped a merge, with what became of its partial output, for the error line.
    `str()` stays the signal's name, as for the plain KeyboardInterrupt the signal handler raises."""

    def __init__(self, signal_name: str, outcome: str):
        super().__init__(signal_name)
        self.outcome = outcome


class AgreedError(MergerError):
    """A failure every rank of a group learned at a sync point: every rank raises it, rank 0 prints it."""


def describe_error(e: BaseException, rank: int, debug: bool) -> str:
    """One line for any failure on a rank: user errors as they are, OS errors with their file, bugs labelled."""
    if isinstance(e, MergerError):
        return str(e)
    if isinstance(e, OSError):
        return f"{(e.strerror or str(e)).lower()}, {e.filename or 'unknown file'}"
    text = f"internal error on rank {rank}: {type(e).__name__}: {e}"
    return text + ("\n" + traceback.format_exc() if debug else "")


def show_error_line(line: str) -> None:
    """Write an error line to stderr in one write() call. Ranks share a terminal or a pipe, and print() writes
    the text and its newline separately: a second rank's line could land between them, mid-line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
