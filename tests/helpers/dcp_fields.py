"""DCP metadata as plain values, so what torch's own classes read and what merger's stand-ins
(merger/sources/dcp_classes.py) read compare field by field: a dataclass becomes its class name and the
value of each field it compares on (class-level defaults included), an enum member its class, name and value."""
from __future__ import annotations

import dataclasses
import enum


def plain(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj).__name__, tuple((f.name, plain(getattr(obj, f.name)))
                                         for f in dataclasses.fields(obj) if f.compare)
    if isinstance(obj, enum.Enum):
        return type(obj).__name__, obj.name, obj.value
    if isinstance(obj, dict):
        return type(obj).__name__, {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # torch.Size too: a tuple, kept apart from one by its name
        return type(obj).__name__, tuple(plain(v) for v in obj)
    return obj
