"""Pickling as Python 3.11.0-3.11.4 do: every enum member as `getattr(EnumClass, "NAME")`.

Those interpreters' Enum.__reduce_ex__ returns `(getattr, (cls, name))`; this Pickler does the same on any
Python, so a checkpoint written here can be given the form such an interpreter would have written.
"""
from __future__ import annotations

import enum
import io
import pickle
import types
from pathlib import Path


class EnumsByName(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


# For torch.save(..., pickle_module=PICKLE_MODULE): torch subclasses pickle_module.Pickler.
PICKLE_MODULE = types.SimpleNamespace(Pickler=EnumsByName, __name__="enums_by_name")


def repickle(path: Path) -> None:
    """Rewrite a pickle file (one written by a library in this test session, so trusted) with enums by name."""
    with open(path, "rb") as f:
        obj = pickle.load(f)
    out = io.BytesIO()
    EnumsByName(out, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    assert b"getattr" in out.getvalue(), f"{path} holds no enum"
    path.write_bytes(out.getvalue())
