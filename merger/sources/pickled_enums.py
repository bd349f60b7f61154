"""Enum members pickled by name, `getattr(EnumClass, "NAME")`: the one call of getattr a checkpoint may make.

Python 3.11.0-3.11.4 pickle every enum member that way (3.11.5 went back to `EnumClass(value)`), so a DCP
`.metadata` or Megatron `args` saved under such an interpreter names builtins.getattr. Allowing getattr itself
would let a pickle reach anything: `getattr(getattr(Metadata, "__init__"), "__globals__")` leads to the
builtins and `eval`. Our unpicklers resolve builtins.getattr to the function made here instead, which looks
a name up among the members of the enum classes that unpickler allows, and refuses every other call.
"""
from __future__ import annotations

import enum
import pickle
from typing import Callable, Iterable

# How a pickle names getattr: protocol 2 (torch.save's default) says __builtin__, later protocols builtins.
GETATTR = {("builtins", "getattr"), ("__builtin__", "getattr")}


def member_lookup(allowed: Iterable[object]) -> Callable[..., enum.Enum]:
    """A stand-in for getattr that returns `EnumClass.__members__[NAME]` for the Enum classes in `allowed`."""
    enums = tuple(c for c in allowed if isinstance(c, type) and issubclass(c, enum.Enum))

    def getattr_enum_member(*args):
        # Identity, not ==: the arguments come from the pickle, and nothing of theirs may be called.
        if (len(args) == 2 and any(args[0] is c for c in enums) and type(args[1]) is str
                and args[1] in args[0].__members__):
            return args[0].__members__[args[1]]
        raise pickle.UnpicklingError(f"refusing to call getattr({', '.join(map(_shown, args))}): getattr is "
                                     f"allowed only to name a member of an allowed enum")

    return getattr_enum_member


def _shown(arg: object) -> str:
    """An argument for the error line, without calling anything the pickle built."""
    if type(arg) is str:
        return repr(arg[:60])
    if isinstance(arg, type):
        return arg.__qualname__
    return f"<{type(arg).__name__}>"
