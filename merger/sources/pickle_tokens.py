"""Where each pickle opcode ends: the argument of every opcode, read as CPython's unpickler reads it.

dcp_compact walks a `.metadata` pickle opcode by opcode without running it; this table says how long each
opcode's argument is (fixed, up to a newline, or given by a length before it), from pickletools' own list.
"""
from __future__ import annotations

import pickletools

_NL, _LEN1, _LEN4S, _LEN4U, _LEN8U = (pickletools.UP_TO_NEWLINE, pickletools.TAKEN_FROM_ARGUMENT1,
                                      pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U,
                                      pickletools.TAKEN_FROM_ARGUMENT8U)
_PREFIX = {_LEN1: 1, _LEN4S: 4, _LEN4U: 4, _LEN8U: 8}  # bytes of the length before the data

# opcode byte -> its argument's length (>= 0), or a pickletools marker; None: no such opcode.
ARGUMENT: list = [None] * 256
# opcode byte -> how many stack items it adds (negative: takes), for opcodes that do not take a MARK's items.
STACK_DELTA: list = [0] * 256
for _op in pickletools.opcodes:
    _code = ord(_op.code.encode("latin-1"))
    ARGUMENT[_code] = _op.arg.n if _op.arg else 0
    STACK_DELTA[_code] = len(_op.stack_after) - len(_op.stack_before)
_TWO_LINES = {ord("c"), ord("i")}  # GLOBAL and INST: module and name, a line each


class TokenError(ValueError):
    """The bytes are not a whole, known opcode."""


def token_end(data: bytes, p: int) -> int:
    """The position just after the opcode at `p` and its argument."""
    op = data[p]
    n = ARGUMENT[op]
    if n is None:
        raise TokenError(f"unknown opcode {op:#04x} at byte {p}")
    if n >= 0:
        end = p + 1 + n
    elif n == _NL:
        end = data.find(b"\n", p + 1) + 1
        if end and op in _TWO_LINES:
            end = data.find(b"\n", end) + 1
        if not end:
            raise TokenError(f"line of opcode {op:#04x} at byte {p} does not end")
    else:
        width = _PREFIX[n]
        length = int.from_bytes(data[p + 1:p + 1 + width], "little", signed=n == _LEN4S)
        if length < 0:
            raise TokenError(f"negative length at byte {p}")
        end = p + 1 + width + length
    if end > len(data):
        raise TokenError(f"opcode {op:#04x} at byte {p} runs past the end")
    return end
