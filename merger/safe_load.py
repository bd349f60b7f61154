"""torch.save files read safely: always weights_only, memory-mapped, each failure one clear MergerError.

Every backend that reads torch.save data (verl FSDP rank files, DCP blobs, Megatron .pt files) should load
through `torch_load`, so a pickle that would run code (a `__reduce__` payload) is refused the same way
everywhere, before anything in it is called, and a damaged file names itself.
"""
from __future__ import annotations

import re

import torch

from .errors import MergerError
from .pickled_enums import member_lookup


def torch_load(path: str, what: str, mmap: bool = True, safe_globals: tuple = ()) -> object:
    """`torch.load(path, weights_only=True)`; `what` names the file in errors ("rank file").

    `safe_globals` allows extra plain classes a format stores beside tensors (e.g. argparse.Namespace);
    enums among them may also be pickled by name (see pickled_enums).
    """
    getattr_enum_member = member_lookup(safe_globals)
    try:
        with torch.serialization.safe_globals([*safe_globals, (getattr_enum_member, "builtins.getattr")]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError as e:
        raise MergerError(f"{what} is missing, {path}") from e
    except Exception as e:  # damaged files raise RuntimeError, UnpicklingError, zip or EOF errors
        text = str(e)
        found = re.search(r"GLOBAL ([\w.]+)", text) if "Weights only load failed" in text else None
        if found:
            # weights_only refuses a global it does not know before calling it: the payload never ran.
            raise MergerError(f"refusing to load {what}: its pickle calls {found.group(1)}, which a weights-only "
                              f"load does not allow (the file is damaged or not a checkpoint), {path}") from e
        found = re.search(r"refusing to call getattr\(.*", text)
        if found:
            raise MergerError(f"refusing to load {what}: {found.group(0)}, {path}") from e
        first_line = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise MergerError(f"cannot load {what} ({first_line}), {path}") from e
