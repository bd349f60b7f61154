"""The two records a DCP `.metadata` repeats millions of times, recognized in the pickle's bytes and read as arrays.

A chunk of `TensorStorageMetadata.chunks` (ChunkStorageMetadata(offsets, sizes)) and an entry of
`Metadata.storage_data` (MetadataIndex(fqn, offset, index): _StorageInfo(relative_path, offset, length)) are
pickled by CPython (protocol 4 and 5, as `pickle.dump` writes them) as the same opcodes every time; only the
ints, and which memo entries they name, change. Each is a regular expression here, over opcodes exactly as the
unpickler reads them (every alternative starts with a different opcode byte, so a record matches in one way
only). The memo entries a record names (its class, its keys, torch.Size) are fixed per run of records and
checked by dcp_compact; the regex only says the bytes are that record and nothing else. Then `decode_*` reads
the fields of many records at once with numpy, from their start positions.
"""
from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

# One opcode and its argument, as expressions: a memo lookup, an int, a short str (pickle_value uses them too).
GET_OP = rb"(?:h.|j.{4})"
INT_OP = rb"(?:K.|M.{2}|J.{4}|\x8a(?:" + b"|".join(bytes([n]) + b".{%d}" % n for n in range(9)) + rb"))"
STR_OP = rb"\x8c(?:" + b"|".join(re.escape(bytes([n])) + b".{%d}" % n for n in range(256)) + rb")"
_TUPLES = {1: rb"\x85", 2: rb"\x86", 3: rb"\x87"}
INT_OPS = np.zeros(256, dtype=bool)
INT_OPS[[ord("K"), ord("M"), ord("J"), 0x8A]] = True

METADATA, FILESYSTEM = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
SIZE = ("global", "torch", "Size")
# What each memo entry a record names must hold: a global, or a str (a key of the object's state).
CHUNK_NAMES = {"c": ("global", METADATA, "ChunkStorageMetadata"), "ko": "offsets", "s1": SIZE, "ks": "sizes",
               "s2": SIZE}
STORAGE_NAMES = {"mi": ("global", METADATA, "MetadataIndex"), "kf": "fqn", "ki": "index", "ko": "offset",
                 "s": SIZE, "si": ("global", FILESYSTEM, "_StorageInfo"), "kr": "relative_path", "ko2": "offset",
                 "kl": "length"}


def _ops(*parts: bytes) -> bytes:
    """Opcodes in a row."""
    return b"".join(parts)


def _named(name: str, literal: bytes | None) -> bytes:
    """A memo lookup: any (captured as `name`, when probing a record) or the given one."""
    return (b"(?P<" + name.encode() + b">" + GET_OP + b")") if literal is None else re.escape(literal)


def _size(get: bytes, nd: int | None, named: bool = False) -> bytes:
    """torch.Size(ints) as pickled: the Size global, (ints,) as its arguments, REDUCE. `nd` ints; None: 0 to 3
    (`named`: which one matched is group n0...n3)."""
    def ints(k: int) -> bytes:
        body = _ops(rb"\)") if k == 0 else _ops(*[INT_OP] * k, _TUPLES[k], rb"\x94")
        return b"(?P<n%d>" % k + body + b")" if named else body
    body = ints(nd) if nd is not None else b"(?:" + b"|".join(ints(k) for k in range(4)) + b")"
    return _ops(get) + body + _ops(rb"\x85", rb"\x94", rb"R", rb"\x94")


def _object(cls: bytes) -> bytes:
    """cls.__new__(cls), memoized, then its state dict opened: `EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK`."""
    return _ops(cls, rb"\)", rb"\x81", rb"\x94", rb"\}", rb"\x94", rb"\(")


def chunk_record(lit: dict, nd: int | None) -> bytes:
    """A ChunkStorageMetadata; nd None: of 0 to 3 dims, which one in group n0...n3 (probing)."""
    return (_object(_named("c", lit.get("c"))) + _ops(_named("ko", lit.get("ko")))
            + _size(_named("s1", lit.get("s1")), nd, named=nd is None)
            + _ops(_named("ks", lit.get("ks"))) + _size(_named("s2", lit.get("s2")), nd) + _ops(b"u", b"b"))


def storage_record(lit: dict) -> bytes:
    """A MetadataIndex(fqn, index, offset of 0 to 3 dims) key, then its _StorageInfo(relative_path, offset,
    length) value: the state keys in the order torch's __init__ sets them."""
    def n(name):
        return _named(name, lit.get(name))
    text = b"(?:" + GET_OP + b"|" + STR_OP + rb"\x94)"  # a str: looked up, or spelled out and memoized
    index = _object(n("mi")) + _ops(n("kf"), text, n("ki"), b"(?:" + INT_OP + b"|N)", n("ko")) + _size(n("s"), None)
    info = _object(n("si")) + _ops(n("kr"), text, n("ko2"), INT_OP, n("kl"), INT_OP)
    return index + _ops(b"u", b"b") + info + _ops(b"u", b"b")


# One record, its memo lookups captured (`n0`...`n3`: the ndim of a chunk), to find which a run fixes.
PROBE_CHUNK = re.compile(chunk_record({}, None), re.DOTALL)
PROBE_STORAGE = re.compile(storage_record({}), re.DOTALL)


@lru_cache(maxsize=64)
def run_pattern(kind: str, literals: tuple, nd: int | None) -> re.Pattern:
    """One record with the memo entries `literals` names fixed."""
    lit = dict(literals)
    return re.compile(chunk_record(lit, nd) if kind == "chunks" else storage_record(lit), re.DOTALL)


class _Walk:
    """Many records read in step: `pos` is each one's next opcode (the regex has checked what follows)."""

    def __init__(self, u8: np.ndarray, starts: np.ndarray):
        self.u8, self.pos, self.last = u8, starts.astype(np.int64), len(u8) - 1

    def at(self, k: int) -> np.ndarray:
        return self.u8[np.minimum(self.pos + k, self.last)].astype(np.int64)

    def le(self, k: int, n: int) -> np.ndarray:
        return sum(self.at(k + i) << (8 * i) for i in range(n))

    def op(self) -> np.ndarray:
        return self.u8[self.pos]

    def move(self, step, mask=None) -> None:
        self.pos = self.pos + (step if mask is None else np.where(mask, step, 0))

    def skip(self, count: int = 1, mask=None) -> None:
        self.move(count, mask)

    def get(self, mask=None) -> np.ndarray:
        long = self.op() == ord("j")
        idx = np.where(long, self.le(1, 4), self.at(1))
        self.move(np.where(long, 5, 2), mask)
        return idx

    def int(self, mask=None) -> np.ndarray:
        op = self.op()
        value = np.where(op == ord("K"), self.at(1), self.le(1, 2))
        j = self.le(1, 4)
        value = np.where(op == ord("J"), np.where(j >= 1 << 31, j - (1 << 32), j), value)
        step = np.select([op == ord("K"), op == ord("M"), op == ord("J")], [2, 3, 5], 0)
        long = op == 0x8A
        if long.any():  # LONG1: n bytes, little-endian two's complement (byte offsets past 2 GiB)
            n = self.at(1)
            raw = np.zeros(len(n), dtype=np.uint64)
            for i in range(8):
                raw |= np.where(i < n, self.at(2 + i), 0).astype(np.uint64) << np.uint64(8 * i)
            raw = raw.view(np.int64)  # 8 bytes: already the two's complement; fewer: below 2**56
            short = (n > 0) & (n < 8)
            negative = short & (((raw >> np.where(short, 8 * n - 1, 0)) & 1) == 1)
            signed = np.where(negative, raw - (np.int64(1) << np.where(negative, 8 * n, 0)), raw)
            value = np.where(long, signed, value)
            step = np.where(long, 2 + n, step)
        self.move(step, mask)
        return value

    def size(self, nd: int) -> np.ndarray:
        self.get()
        if nd:
            ints = np.stack([self.int() for _ in range(nd)], axis=1)
            self.skip(2)
        else:
            ints = np.zeros((len(self.pos), 0), dtype=np.int64)
            self.skip()
        self.skip(4)
        return ints

    def size_any(self) -> tuple[np.ndarray, np.ndarray]:
        """(ndim, ints in 3 columns) of Sizes of 0 to 3 dims."""
        self.get()
        empty = self.op() == ord(")")
        self.skip(mask=empty)
        nd = np.zeros(len(self.pos), dtype=np.int64)
        ints = np.zeros((len(self.pos), 3), dtype=np.int64)
        for d in range(3):
            more = ~empty & INT_OPS[self.op()]
            ints[:, d] = np.where(more, self.int(mask=more), 0)
            nd += more
        self.skip(2, mask=~empty)
        self.skip(4)
        return nd, ints


def decode_chunks(u8: np.ndarray, starts: np.ndarray, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes), `nd` columns each, of the chunk records at `starts`."""
    w = _Walk(u8, starts)
    w.get()
    w.skip(6)
    w.get()
    offsets = w.size(nd)
    w.get()
    return offsets, w.size(nd)


def chunk_memos(nd: int) -> int:
    """Memo entries a chunk record makes: the object, its state, and per Size its ints (unless empty), (ints,), it."""
    return 2 + 2 * (3 if nd else 2)


def decode_storage(u8: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """The fields of the storage records at `starts`: the fqn and path (each a string at `<name>_at` of
    `<name>_len` bytes where `<name>_literal`, else the memo index `<name>_get`), index (None: `index_none`), the
    key's ndim and offsets, the byte offset and length, and the memo entries each record makes."""
    w = _Walk(u8, starts)
    out = {}

    def text(name: str) -> None:
        literal = w.op() == 0x8C
        out[f"{name}_len"], out[f"{name}_at"], out[f"{name}_literal"] = w.at(1), w.pos + 2, literal
        w.move(2 + out[f"{name}_len"], literal)
        w.skip(mask=literal)
        out[f"{name}_get"] = w.get(mask=~literal)

    w.get()
    w.skip(6)
    w.get()
    text("fqn")
    w.get()
    none = w.op() == ord("N")
    out["index"], out["index_none"] = w.int(mask=~none), none
    w.skip(mask=none)
    w.get()
    out["nd"], out["key_offsets"] = w.size_any()
    w.skip(2)
    w.get()
    w.skip(6)
    w.get()
    text("path")
    w.get()
    out["byte_offset"] = w.int()
    w.get()
    out["length"] = w.int()
    out["memos"] = 4 + np.where(out["nd"] > 0, 3, 2) + out["fqn_literal"] + out["path_literal"]
    return out
