"""torch.save files read safely: always weights_only, memory-mapped, each failure one clear MergerError.

Every backend that reads torch.save data (verl FSDP rank files, DCP blobs, Megatron .pt files) should load
through `torch_load`, so a pickle that would run code (a `__reduce__` payload) is refused the same way
everywhere, before anything in it is called, and a damaged file names itself.
"""
from __future__ import annotations

import os
import pickle
import re
import zipfile

import torch

from ..errors import CorruptSourceError, MergerError, SourceError
from ..io.zip_shadow import open_shadow, zip_shadow
from .pickled_enums import member_lookup

_ZIP = b"PK\x03\x04"  # torch.save since torch 1.6: a zip archive
# Before that, a plain pickle stream that starts with torch's magic number (after the protocol opcodes).
_LEGACY = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[2:-1]


def torch_load(path: str, what: str, mmap: bool = True, safe_globals: tuple = ()) -> object:
    """`torch.load(path, weights_only=True)`; `what` names the file in errors ("rank file").

    `safe_globals` allows extra plain classes a format stores beside tensors (e.g. argparse.Namespace), or
    `(stand_in, "module.Name")` pairs that resolve a name to a class of ours; enums among them may also be
    pickled by name (see pickled_enums).
    """
    getattr_enum_member = member_lookup(g[0] if isinstance(g, tuple) else g for g in safe_globals)
    try:
        local = zip_shadow(path)  # an object in a bucket: all but its tensors' bytes, in a local file
        with open_shadow(path) as f:
            head = f.read(32)
        if not head:
            raise CorruptSourceError(f"cannot load {what}: the file is empty, {path}")
        if not head.startswith(_ZIP):
            if _LEGACY not in head:
                raise CorruptSourceError(f"cannot load {what}: not a torch.save file (neither a zip archive nor "
                                         f"torch's legacy pickle format), {path}")
            if mmap:
                raise MergerError(f"cannot load {what}: saved in torch's legacy (before 1.6) format, which cannot "
                                  f"be memory-mapped, {path}")
        with torch.serialization.safe_globals([*safe_globals, (getattr_enum_member, "builtins.getattr")]):
            return torch.load(local, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError as e:
        raise SourceError(f"{what} is missing, {path}") from e
    except MergerError:
        raise
    except Exception as e:  # damaged files raise RuntimeError, UnpicklingError, zip or EOF errors
        text = str(e)
        found = re.search(r"GLOBAL ([\w.]+)", text) if "Weights only load failed" in text else None
        if found:
            # weights_only refuses a global it does not know before calling it: the payload never ran.
            raise CorruptSourceError(f"refusing to load {what}: its pickle calls {found.group(1)}, which a "
                                     f"weights-only load does not allow (the file is damaged or not a checkpoint), "
                                     f"{path}") from e
        found = re.search(r"refusing to call getattr\(.*", text)
        if found:
            raise MergerError(f"refusing to load {what}: {found.group(0)}, {path}") from e
        check_zip_end(path)
        first_line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise CorruptSourceError(f"cannot load {what} ({first_line}), {path}") from e


def check_zip_end(path: str) -> None:
    """Refuse a torch.save zip whose directory, at the end of the file, cannot be found: what a copy cut short or
    an interrupted save leaves (torch.load then says only "Invalid argument" or the like). It reads the file's
    first bytes and its end, no tensor's bytes, so a plan checks every source file with it (Catalog.check_file)
    and `inspect` names a truncated file that it would not otherwise open. A file that is no zip is left to
    torch_load, which says what it is."""
    try:
        with open_shadow(path) as f:
            if f.read(4) != _ZIP or zipfile.is_zipfile(f):
                return
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return  # missing or unreadable: the load says which
    raise CorruptSourceError(f"truncated: the file's {size} bytes end without the zip directory that ends a "
                             f"torch.save file (copied or saved only in part?), {path}")
