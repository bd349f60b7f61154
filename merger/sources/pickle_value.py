"""Whether a stretch of a pickle is one value that touches nothing outside itself, checked without running it.

dcp_compact skips megatron-core's `all_local_plans` (a WriteItem per chunk, which merger never reads: 60 % of
a 116 MiB `.metadata`) instead of walking it opcode by opcode and unpickling it. Skipping is only right where the
bytes, run, would do nothing but push one new value and add memo entries: no object made before them changed,
nothing below them on the stack taken. This module checks that at the regular-expression engine's speed:
- the stretch is cut into opcodes exactly as the unpickler reads them (one expression per opcode and argument;
  each opcode's first byte decides its length), a frame at a time, so every frame header in it stands between
  two opcodes; any opcode outside a short list (no PUT, POP, DUP, persistent id, GLOBAL, INST, OBJ, EXT, STOP)
  and the stretch is not taken;
- the opcodes, one byte each, are then reduced as the stack machine would combine them, innermost first (a
  pickle is postfix: an opcode's operands are the values right before it): atoms to a value; a tuple of
  values, a global of two, a call of two (REDUCE) to a value; NEWOBJ to a new object, BUILD only on such a new
  object; APPEND(S) only to a list made by EMPTY_LIST in the stretch, SETITEM(S) only to a dict made by
  EMPTY_DICT in it. What a memo lookup gives is only ever an operand, never the object a BUILD, APPENDS or
  SETITEMS changes. The stretch is one self-contained value where this ends in a single value.
Nothing of the stretch is unpickled: a global it names is never resolved, a call never made.
"""
from __future__ import annotations

import re

from .dcp_records import GET_OP, INT_OP, STR_OP

_MEMOIZE = b"\x94"
# The opcodes a value may hold, in the order most are met (the expression tries them in turn).
_ONE_BYTE = b"\x94()\x81}ubNR\x85\x86\x87e]\x93\x88\x89ast"
_OPCODE = b"|".join([GET_OP, INT_OP, STR_OP, b"[" + re.escape(_ONE_BYTE) + b"]"])
_OPCODES = re.compile(b"(?:" + _OPCODE + b")*+", re.DOTALL)
_FIRST_BYTES = re.compile(b"(?=(.))(?:" + _OPCODE + b")", re.DOTALL)  # each opcode: its first byte, captured

# Opcodes as the reduction's symbols: V a value, L a new list, D a new dict, O a new object; the rest as they are.
_SYMBOL = bytearray(range(256))
for _op in b"hjKMJ\x8a\x8cN\x88\x89)":
    _SYMBOL[_op] = ord("V")
_SYMBOL[ord("]")], _SYMBOL[ord("}")] = ord("L"), ord("D")
_SYMBOL = bytes(_SYMBOL)
_X = b"[VLDO]"
# The shapes most opcodes make (a torch.Size or enum: global, args, REDUCE; NEWOBJ with no args), reduced first by
# plain replacing, 2x faster than the expressions: each is as valid a reduction anywhere as theirs.
_COMMON = [(b"VVV\x87", b"V"), (b"VV\x86", b"V"), (b"V\x85", b"V"), (b"VVR", b"V"), (b"VV\x81", b"O")]
_REDUCE = [  # (what, what it becomes), applied in turn until nothing changes
    (re.compile(_X + rb"\x85|" + _X * 2 + rb"[\x86\x93R]|" + _X * 3 + rb"\x87|\(" + _X + b"*t"), b"V"),
    (re.compile(_X * 2 + rb"\x81|O" + _X + b"b"), b"O"),
    (re.compile(rb"L(?:\(" + _X + b"*e|" + _X + b"a)"), b"L"),
    (re.compile(rb"D(?:\((?:" + _X * 2 + b")*u|" + _X * 2 + b"s)"), b"D"),
]


def value_memos(data, start: int, end: int, frames: list[int]) -> int | None:
    """The memo entries `data[start:end]` makes, if it is one self-contained value (above); else None. `frames`:
    where frame headers were taken out of `data` (sorted), each of which must fall between two opcodes."""
    cuts = [start] + [f for f in frames if start < f < end] + [end]
    ops = []
    for a, b in zip(cuts, cuts[1:]):
        if not _OPCODES.fullmatch(data, a, b):
            return None
        # A list of 1-byte objects (CPython's shared ones: nothing made per opcode), joined a frame at a time
        ops.append(b"".join(_FIRST_BYTES.findall(data, a, b)))
    ops = b"".join(ops)
    symbols = ops.translate(_SYMBOL, _MEMOIZE)
    for shape, made in _COMMON:
        symbols = symbols.replace(shape, made)
    while len(symbols) > 1:
        before = len(symbols)
        for pattern, made in _REDUCE:
            symbols = pattern.sub(made, symbols)
        if len(symbols) == before:
            return None
    return ops.count(_MEMOIZE) if symbols in (b"V", b"L", b"D", b"O") else None
