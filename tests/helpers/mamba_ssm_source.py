"""mamba_ssm's Python source, which megatron-core's MambaMixer imports, for the Nemotron-H test writer.

`pip install mamba-ssm` builds CUDA kernels and fails without CUDA, so the writer runs the sdist's source from
PYTHONPATH with mamba_ssm's own torch references (tests/writers/megatron_nemotron_h.py). pip downloads the sdist once
into pytest's cache folder; its metadata step runs the sdist's setup.py, which MAMBA_SKIP_CUDA_BUILD keeps off
CUDA and --no-build-isolation lets import the torch installed here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "2.3.2.post1"  # PyPI has no sdist of 2.3.2 itself


def mamba_ssm_source(cache: Path) -> Path:
    """The unpacked mamba-ssm sdist under `cache`, downloaded the first time; a skip when pip cannot download it."""
    folder = cache / f"mamba_ssm-{VERSION}"
    if (folder / "mamba_ssm" / "__init__.py").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", f"mamba-ssm=={VERSION}", "--no-deps",
                               "--no-binary", ":all:", "--no-build-isolation", "--dest", tmp],
                              env={**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE"}, capture_output=True, text=True,
                              timeout=600)
        archives = list(Path(tmp).glob("mamba_ssm-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
            pytest.skip(f"pip could not download the mamba-ssm {VERSION} sdist (megatron-core's MambaMixer needs its "
                        f"source): {last[0] if last else proc.returncode}")
        with tarfile.open(archives[0]) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
                tar.extractall(tmp, filter="data")
            else:  # Debian's 3.11.2: the same refusals for what an sdist holds, checked by hand
                _check_members(tar, archives[0])
                tar.extractall(tmp)
        os.replace(Path(tmp) / f"mamba_ssm-{VERSION}", folder)  # whole or not at all, for the next session
    return folder


def _check_members(tar: tarfile.TarFile, archive: Path) -> None:
    """Only files and folders inside the archive's own folder: no absolute path, no `..`, no link or device."""
    for member in tar.getmembers():
        parts = Path(member.name).parts
        if Path(member.name).is_absolute() or ".." in parts or not (member.isfile() or member.isdir()):
            raise AssertionError(f"{archive} holds {member.name!r}, which an sdist should not")
