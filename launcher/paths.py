"""Where the launched processes find `merger` and `launcher`: the folder this copy was imported from."""
from __future__ import annotations

import os
from pathlib import Path

# The parent of the `launcher` package: a source checkout's root, or site-packages of an installed copy.
ROOT = Path(__file__).resolve().parent.parent


def python_path(existing: str | None) -> str:
    """PYTHONPATH that puts this copy first, so ranks import exactly the code that launched them."""
    return os.pathsep.join([str(ROOT)] + ([existing] if existing else []))
