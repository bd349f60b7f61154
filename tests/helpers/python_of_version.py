"""The one rule for "this machine has Python X.Y": pyenv's X.Y.z, else pythonX.Y on PATH. The Makefile (which builds
.venv-writers312 from a 3.12), .ci/run (which byte-compiles with a 3.10) and the tests (which skip where make built
no writer venv) all ask this file, so they never disagree: a run with Debian's python3 first on PATH and pyenv not on
PATH still finds pyenv's versions, through $PYENV_ROOT or ~/.pyenv.

    python3 tests/helpers/python_of_version.py 3.12   # prints the interpreter's path, or nothing

Standard library only: make runs it with whatever python3 it has, before any venv exists.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path


def pyenv_root() -> Path:
    """$PYENV_ROOT, else pyenv's default root: pyenv itself need not be on PATH for its versions to be there."""
    return Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")


def python_of_version(version: str) -> str | None:
    """An interpreter of `version` ("3.12"), as a path; None where the machine has none."""
    candidates = sorted(glob.glob(str(pyenv_root() / "versions" / f"{version}.*" / "bin" / "python")))
    candidates += [found for found in [shutil.which(f"python{version}")] if found]
    wanted = tuple(int(part) for part in version.split("."))
    for python in candidates:
        check = subprocess.run([python, "-c", f"import sys; assert sys.version_info[:2] == {wanted!r}"],
                               capture_output=True)
        if check.returncode == 0:
            return python
    return None


if __name__ == "__main__":
    found = python_of_version(sys.argv[1])
    if found:
        print(found)
