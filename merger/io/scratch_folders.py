"""The process's scratch folders in $TMPDIR (a bucket's HF config folder copied locally, sparse shadows of its
torch.save files): made here, all removed when the process ends.

atexit removes them where the process ends normally (an in-process caller of merger.api). The `merger` command and
a rank that a peer's loss ends leave with os._exit, which runs no atexit handler: they call remove_all() first."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

_MADE: list[Path] = []


def scratch_folder(prefix: str) -> Path:
    """A new empty folder in $TMPDIR whose name starts with `prefix`, removed by remove_all()."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _MADE.append(folder)
    return folder


def remove_all() -> None:
    """Remove every scratch folder made so far; for the end of the process, when nothing reads them any more."""
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)


atexit.register(remove_all)
