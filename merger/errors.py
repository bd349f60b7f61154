"""The exceptions that reach users as a single `merger: error: ...` line, and the kinds a caller branches on.

Each kind is a subclass of MergerError (so `except MergerError` catches them all) with a `kind` name and the exit
code the CLI ends with. The codes above 2 are sysexits.h's, which shell scripts and supervisors already know:
EX_DATAERR 65, EX_NOINPUT 66, EX_CANTCREAT 73, EX_TEMPFAIL 75 (try again later), EX_NOPERM 77.
"""
from __future__ import annotations

import errno
import sys
import traceback
from dataclasses import dataclass


class MergerError(Exception):
    """A problem with the user's input or environment, not a bug in merger.

    The CLI prints it as one line (no traceback unless --debug) and exits with its kind's code.
    Messages say what is wrong and name the file involved: `<what>, <which file>`.
    A plain MergerError is the kind "other": input merger cannot use (an unsupported layout or option,
    a model it cannot map) that a caller has no other way to handle than to read the line.
    """
    kind = "other"
    exit_code = 1
    # True when every rank of a group raised this same error at a sync point: the CLI prints it from rank 0 only.
    agreed = False


class UsageError(MergerError):
    """A command line, or the API's keyword options, that do not parse."""
    kind, exit_code = "usage", 2


class SourceError(MergerError):
    """The checkpoint is not there to read: a missing or unreadable folder or file, or a folder that is no
    checkpoint merger knows (nor its HF config folder)."""
    kind, exit_code = "source", 66


class CorruptSourceError(MergerError):
    """A source file that is there but damaged: truncated, a malformed header, a failed checksum."""
    kind, exit_code = "corrupt", 65


class TargetError(MergerError):
    """The target cannot take the merged model: not writable, not empty, not enough space; or the scratch folder
    ($TMPDIR) cannot take merger's local copies of a bucket's files."""
    kind, exit_code = "target", 73


class TargetBusyError(MergerError):
    """Another merge holds the target's lock: trying again once it ends can succeed."""
    kind, exit_code = "target_busy", 75


class StoreUnavailableError(MergerError):
    """The object store throttled, reset or stalled every try its client's retries allow: the same request may
    succeed later (EX_TEMPFAIL, as for a busy target)."""
    kind, exit_code = "store_unavailable", 75


class CredentialsError(MergerError):
    """The object store refused the credentials, or found none."""
    kind, exit_code = "credentials", 77


class AgreedError(MergerError):
    """A failure every rank of a group learned at a sync point that is no other kind (ranks that see different
    checkpoints, a verification that failed): every rank raises it, rank 0 prints it."""
    agreed = True


KINDS: dict[str, type[MergerError]] = {c.kind: c for c in (MergerError, UsageError, SourceError,
                                                            CorruptSourceError, TargetError, TargetBusyError,
                                                            StoreUnavailableError, CredentialsError)}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a SIGTERM) that stopped a merge, with what became of its partial output, for the error line.
    `str()` stays the signal's name, as for the plain KeyboardInterrupt the signal handler raises. A
    KeyboardInterrupt, not a MergerError, so that code that lets Ctrl-C through still does."""
    kind, exit_code = "interrupted", 130

    def __init__(self, signal_name: str, outcome: str):
        super().__init__(signal_name)
        self.outcome = outcome


@dataclass(frozen=True)
class Failure:
    """What a failed rank tells the others at a sync point: its error line and the error's kind, so that every
    rank raises the same class (a SourceError on rank 1 is a SourceError on rank 0 too)."""
    line: str
    kind: str = "other"

    @property
    def error_class(self) -> type[MergerError]:
        return KINDS.get(self.kind, MergerError)

    @property
    def exit_code(self) -> int:
        return self.error_class.exit_code

    def error(self, agreed: bool = False) -> MergerError:
        """The error to raise for it; `agreed`: every rank raises it at once, and only rank 0 prints it."""
        error = self.error_class(self.line)
        error.agreed = agreed
        return error


# OS errors whose kind is certain whatever merger was doing, since only writes meet them: a full disk or quota, a
# file over the size limit, a read-only filesystem.
_TARGET_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def shared_exit_code(codes: list[int]) -> int:
    """The exit code for several failures (steps a watch could not convert, damaged files `inspect --check`
    found): theirs when they share one, so a script can still branch on it; else 1."""
    return codes[0] if len(set(codes)) == 1 else MergerError.exit_code


def kind_of(e: BaseException) -> str:
    """The kind of any failure on a rank: a MergerError's own, "target" for an OS error only writes meet, else
    "other" (a bug, or an OS error that could be the source's or the target's)."""
    if isinstance(e, MergerError):
        return e.kind
    if isinstance(e, OSError) and e.errno in _TARGET_ERRNOS:
        return TargetError.kind
    return MergerError.kind


def os_reason(e: OSError) -> str:
    """What an OS error says, as the middle of a sentence: "no space left on device"."""
    return (e.strerror or str(e)).lower()


def describe_error(e: BaseException, rank: int, debug: bool) -> str:
    """One line for any failure on a rank: user errors as they are, OS errors with their file, bugs labelled."""
    if isinstance(e, MergerError):
        return str(e)
    if isinstance(e, OSError):
        return f"{os_reason(e)}, {e.filename or 'unknown file'}"
    text = f"internal error on rank {rank}: {type(e).__name__}: {e}"
    return text + ("\n" + traceback.format_exc() if debug else "")


def failure_of(e: BaseException, rank: int, debug: bool) -> Failure:
    """The Failure a rank reports for `e` at the next sync point."""
    return Failure(describe_error(e, rank, debug), kind_of(e))


def show_error_line(line: str) -> None:
    """Write an error line to stderr in one write() call. Ranks share a terminal or a pipe, and print() writes
    the text and its newline separately: a second rank's line could land between them, mid-line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
