"""The process's scratch folders in $TMPDIR (a bucket's HF config folder copied locally, sparse shadows of its
torch.save files): made here, all removed when the process ends.

atexit removes them where the process ends normally (an in-process caller of merger.api). The `merger` command and
a rank that a peer's loss ends leave with os._exit, which runs no atexit handler: they call remove_all() first."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import TargetError, os_reason

_MADE: list[Path] = []


def scratch_folder(prefix: str) -> Path:
    """A new empty folder in $TMPDIR whose name starts with `prefix`, removed by remove_all()."""
    try:
        folder = Path(tempfile.mkdtemp(prefix=prefix))
    except OSError as e:
        raise TargetError(f"cannot make a scratch folder in TMPDIR ({os_reason(e)}), "
                          f"{tempfile.gettempdir()}") from e
    _MADE.append(folder)
    return folder


@contextmanager
def copying(origin: str, copy: Path | str) -> Iterator[None]:
    """The writes of `copy`, a scratch folder's local copy of `origin`: an OSError they raise (a full $TMPDIR: a
    write's ENOSPC names no file) becomes one line naming both and the folder, not a fault of the source."""
    try:
        yield
    except OSError as e:
        raise TargetError(f"{os_reason(e)} for the local copy of {origin} in the scratch folder "
                          f"(TMPDIR), {copy}") from e


def remove_all() -> None:
    """Remove every scratch folder made so far; for the end of the process, when nothing reads them any more."""
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)


atexit.register(remove_all)
