"""A DCP `.metadata` read with its chunks and storage entries as arrays, never as an object each.

A 671B model saved by 64 ranks pickles 2.9 M ChunkStorageMetadata and as many MetadataIndex/_StorageInfo pairs:
unpickled, about 20 objects per chunk, all kept in the unpickler's memo until the load ends (6 GiB, and a minute
of CPython's cyclic GC walking them). Here the pickle is first walked opcode by opcode without running it:
every run of those records that fills a list (`MARK records APPENDS`) or a dict (`MARK records SETITEMS`)
is found by the regular expressions of dcp_records, read into numpy arrays, and cut out of the stream; a
persistent id takes its place (the whole run: one item of the list, one key of the dict, `Rows`). What is left
(the tensors' headers, planner data: a few objects per tensor) is then loaded by the same restricted unpickler
as before (dcp_metadata), so every global still goes through its allowed list and nothing else is called.

The cut records' memo entries are gone from the rewritten stream, so every later memo index is renumbered; a
later reference to an entry inside a run (an object shared by identity) becomes a persistent id too, whose
object is made from the arrays. A run is taken only where the memo entries its records name are the expected
classes and keys (tracked for strings and globals while walking), and only in protocol 4+ form (MEMOIZE).
Anything this walk does not understand raises here; dcp_metadata then loads the original bytes the old way.

megatron-core's torch_dist adds `all_local_plans` last to the metadata's state: a SavePlan per rank, a WriteItem per
chunk (8192 ranks, TP8 experts: 60 % of the pickle, and memo lookups into every chunk run). Merger never reads it.
Where it is the last value of the pickle and one that touches nothing outside itself (pickle_value checks that
at regular-expression speed), it is skipped unread: NOT_READ takes its place, a persistent id like the runs'.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
import torch

from .dcp_classes import ChunkStorageMetadata, MetadataIndex, _StorageInfo
from .dcp_records import (CHUNK_NAMES, PROBE_CHUNK, PROBE_STORAGE, STORAGE_NAMES, chunk_memos,
                          decode_chunks, decode_storage, run_pattern)
from .pickle_tokens import STACK_DELTA, TokenError, token_end
from .pickle_value import value_memos

_MEMOIZE, _MARK, _STOP, _STACK_GLOBAL, FRAME = 0x94, ord("("), ord("."), 0x93, 0x95
_APPENDS, _SETITEMS, _EMPTY_LIST, _EMPTY_DICT = ord("e"), ord("u"), ord("]"), ord("}")
# The state key whose list / dict a run may fill: a record run is cut only there.
_HOLDS = {"chunks": "chunks", "storage_data": "storage"}
_GETS = {ord("g"): 0, ord("h"): 1, ord("j"): 4}  # opcode -> bytes of its index (0: a decimal line)
_PUTS = {ord("p"): 0, ord("q"): 1, ord("r"): 4}
_STRINGS = {0x8C: 2, ord("X"): 5, 0x8D: 9}  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 -> header bytes
_PERSISTENT = {ord("P"), ord("Q")}
# Opcodes that take the items since the last MARK: TUPLE, LIST, DICT, POP_MARK, INST, OBJ, FROZENSET, ADDITEMS.
_POP_MARK = ord("1")
_TAKE_MARK = {ord(c) for c in "tld1io"} | {0x91, 0x90}
_RECORD_CLASS = {"chunks": CHUNK_NAMES["c"], "storage": STORAGE_NAMES["mi"]}
# (kind, a single record) -> the opcode that adds the records to their list / dict
_CLOSERS = {("chunks", False): _APPENDS, ("chunks", True): ord("a"), ("storage", False): _SETITEMS,
            ("storage", True): ord("s")}
# The state key whose value is skipped unread where it is the last one: megatron-core's SavePlans (a WriteItem per
# chunk) in torch_dist's `.metadata`, kept there only to check a cached plan on its next save.
_NOT_READ_KEY = "all_local_plans"
_SPECIAL = {_MEMOIZE, _MARK, _STOP, _STACK_GLOBAL, FRAME, _APPENDS, _SETITEMS, _EMPTY_LIST, _EMPTY_DICT, *_GETS,
            *_PUTS, *_STRINGS, *_PERSISTENT, *_TAKE_MARK}


class NotRead:
    """What stands in the metadata for a value dcp_compact skipped unread (see _skip)."""


NOT_READ = NotRead()


@dataclass(frozen=True)
class Rows:
    """Records `start:stop` of the arrays of `kind` ("chunks" or "storage"), where the pickle had them."""

    kind: str
    start: int
    stop: int


_STORAGE_FIELDS = {"fqn": (), "index": (), "index_none": (), "nd": (), "key_offsets": (3,), "path": (),
                   "byte_offset": (), "length": ()}  # name -> shape of a row


def _no_storage() -> dict:
    return {k: np.zeros((0, *shape), dtype=bool if k == "index_none" else np.int64)
            for k, shape in _STORAGE_FIELDS.items()}


@dataclass
class CompactRecords:
    """The records cut out of the pickle. Chunks: offsets and sizes (3 columns, `chunk_nd` used). Storage entries:
    `fqn` and `path` index `strings`; `index` is -1 where `index_none`; key offsets as the chunks'."""

    chunk_nd: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_offsets: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    chunk_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    storage: dict = field(default_factory=_no_storage)  # name -> array, as decode_storage, fqn and path as ids
    strings: list = field(default_factory=list)

    def chunk(self, row: int) -> ChunkStorageMetadata:
        nd = int(self.chunk_nd[row])
        return ChunkStorageMetadata(torch.Size(self.chunk_offsets[row, :nd].tolist()),
                                    torch.Size(self.chunk_sizes[row, :nd].tolist()))

    def storage_entry(self, row: int) -> tuple[MetadataIndex, _StorageInfo]:
        s = self.storage
        index = None if s["index_none"][row] else int(s["index"][row])
        key = MetadataIndex(self.strings[s["fqn"][row]], torch.Size(s["key_offsets"][row, :s["nd"][row]].tolist()),
                            index)
        return key, _StorageInfo(self.strings[s["path"][row]], int(s["byte_offset"][row]), int(s["length"][row]))

    def take_chunks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk_nd, chunk_offsets, chunk_sizes), handed over: the records keep none of them, so that whoever
        builds from them holds one copy at its peak (2.9 M chunks: 160 MB)."""
        out, empty = (self.chunk_nd, self.chunk_offsets, self.chunk_sizes), CompactRecords()
        self.chunk_nd, self.chunk_offsets, self.chunk_sizes = empty.chunk_nd, empty.chunk_offsets, empty.chunk_sizes
        return out

    def take_storage(self) -> dict:
        """`storage`, handed over as take_chunks hands the chunks."""
        out, self.storage = self.storage, _no_storage()
        return out

    def expanded(self, rows: Rows) -> list:
        """The objects the pickle held in place of `rows`: chunks, or (key, info) pairs."""
        made = self.chunk if rows.kind == "chunks" else self.storage_entry
        return [made(r) for r in range(rows.start, rows.stop)]


@dataclass
class _Run:
    """A cut run: its memo entries are old indices `memo:memo + size`; `record_memos`: each record's first."""

    memo: int
    size: int
    rows: Rows
    record_memos: np.ndarray
    part: int | None = None  # storage: its fields are storage_parts[part]


def _size_entries(size: torch.Size) -> list:
    """The memo entries a pickled torch.Size makes, in order: its ints (unless none), (ints,), the Size."""
    return ([tuple(size)] if len(size) else []) + [(tuple(size),), size]


def _strip_frames(data: bytearray) -> list[int]:
    """Cuts the chain of FRAME headers CPython writes (PROTO, then frame after frame) out of `data`, in place, so
    that records match without them. Returns where each was in the result: the walk checks that every one is
    where an opcode starts (else the header was not an opcode, and the stripped bytes are not the pickle)."""
    n, src, dst, at = len(data), 2, 2, []
    if n < 2 or data[0] != 0x80:
        return at
    while src + 9 <= n and data[src] == FRAME:
        length = int.from_bytes(data[src + 1:src + 9], "little")
        if src + 9 + length > n:
            break
        at.append(dst)
        data[dst:dst + length] = data[src + 9:src + 9 + length]
        dst, src = dst + length, src + 9 + length
    if at:
        data[dst:dst + n - src] = data[src:n]
        del data[dst + n - src:]
    return at


class _Rewriter:
    def __init__(self, data: bytearray):
        self.frames = _strip_frames(data) + [len(data) + 1]  # then a stop past the end
        self.data, self.u8 = data, np.frombuffer(data, dtype=np.uint8)
        # The rewritten pickle, grown in place: a piece per renumbered lookup, kept apart, were millions of small
        # objects (the 671B torch_dist stress case's load peaked at 1.53 GiB with them, 0.77 without)
        self.out = bytearray()
        self.count = 0  # memo entries so far, old numbering
        self.known: dict[int, object] = {}  # old memo index -> its str, or ("global", module, name)
        self.runs: list[_Run] = []
        self.run_memos: list[int] = []  # each run's first old memo index, for bisect
        self.cut_before: list[int] = [0]  # memo entries cut by runs before run i (and the total, last)
        self.markers: list = []  # persistent id -> Rows, or a (run, offset) reference
        self.chunk_groups: dict[int, list] = {}  # ndim -> [(starts, first row)]
        self.chunk_rows = 0
        self.storage_parts: list[dict] = []
        self.storage_rows = 0
        self.string_ids: dict[str, int] = {}  # fqns and paths of the records cut -> their index in `strings`
        self.records = CompactRecords()
        self.skipped = False  # whether _NOT_READ_KEY's value was skipped
        # The end of a run that stopped short of its APPENDS / SETITEMS: a probe at a record inside it would fix the
        # same memo entries and stop there again (megatron-core's storage_data puts an `_extra_state` entry, its
        # key without an offset, between tensors' entries: without this, each entry rescans the rest of its run).
        self.no_cut_before = 0

    # -- memo numbering ------------------------------------------------------------------------------------
    def _run_of(self, idx: int):
        i = bisect_right(self.run_memos, idx) - 1
        return (i, self.runs[i]) if i >= 0 else (-1, None)

    def _renumbered(self, idx: int, get: bool) -> bytes:
        """A GET of old index `idx` in the rewritten stream: LONG_BINGET of its new index, or a persistent id
        for an entry inside a cut run. For a PUT (`get` False): LONG_BINPUT."""
        i, run = self._run_of(idx)
        if run is not None and idx < run.memo + run.size:
            if not get:
                raise TokenError(f"a PUT overwrites memo entry {idx} of a record")
            return self._persistent(("ref", i, idx - run.memo))
        new = idx - self.cut_before[i + 1 if run is not None else 0]
        return (b"j" if get else b"r") + new.to_bytes(4, "little")

    def _persistent(self, what) -> bytes:
        self.markers.append(what)
        return b"J" + (len(self.markers) - 1).to_bytes(4, "little", signed=True) + b"Q"

    # -- the walk --------------------------------------------------------------------------------------------
    def run(self) -> bytes:
        data, n = self.data, len(self.data)
        if n < 2 or data[0] != 0x80 or data[1] < 4:  # the records match only as protocol 4+ writes them (MEMOIZE)
            raise TokenError("not a protocol 4+ pickle")
        p = keep = 0  # data[keep:p] goes to the output as it is
        top = below = None  # the two values last pushed, where known (str or global)
        holds = None  # "chunks"/"storage": the list / dict just pushed is the value of that state key
        depth = 0  # stack items above the last MARK
        marks = []  # per open MARK: (what `holds` was there: the list / dict its items go to, `depth` there)
        frame, next_frame = 0, self.frames[0]
        while True:
            if p >= next_frame:
                if p != next_frame:
                    raise TokenError("a frame header inside an opcode")
                frame += 1
                next_frame = self.frames[frame]
            if p >= n:
                raise TokenError("no STOP opcode")
            op = data[p]
            end = token_end(data, p)
            if op not in _SPECIAL:
                top = below = holds = None
                depth += STACK_DELTA[op]
            elif op in _GETS:
                idx = self._index(p, end, _GETS[op])
                if idx >= self.count:
                    raise TokenError(f"memo entry {idx} is read before it is set")
                # An item of a chunks list, or a key of storage_data, starts: perhaps records to cut. Right above
                # the list / dict (`holds`), one record, which APPEND / SETITEM adds; else in a batch above its MARK.
                single = holds is not None
                kind = holds or (marks[-1][0] if marks else None)
                if kind and p >= self.no_cut_before and (single or kind == "chunks" or depth % 2 == 0) \
                        and self.known.get(idx) == _RECORD_CLASS[kind]:
                    cut = self._cut(p, kind, single)
                    if cut:
                        resume, marker = cut
                        self.out += data[keep:p] + marker
                        p = keep = resume
                        if not single:
                            depth += 1 if kind == "chunks" else 2
                        top = below = None
                        holds = kind if single else None
                        while next_frame < p:  # checked by _frames_in
                            frame += 1
                            next_frame = self.frames[frame]
                        continue
                top, below, holds = self.known.get(idx), top, None
                depth += 1
                if self.runs and idx >= self.runs[0].memo:
                    self.out += data[keep:p] + self._renumbered(idx, get=True)
                    keep = end
            elif op == _MEMOIZE:
                if top is not None:
                    self.known[self.count] = top
                self.count += 1
            elif op in (_EMPTY_LIST, _EMPTY_DICT):
                if top == _NOT_READ_KEY and op == _EMPTY_LIST and self._skip(p):
                    self.out += data[keep:p] + self._persistent(NOT_READ)
                    p = keep = n - 3
                    while next_frame < p:  # checked by value_memos
                        frame += 1
                        next_frame = self.frames[frame]
                    top = below = holds = None
                    depth += 1
                    continue
                holds = _HOLDS.get(top) if type(top) is str else None
                top = below = None
                depth += 1
            elif op == _MARK:
                marks.append((holds, depth))
                top = below = holds = None
                depth = 0
            elif op in (_APPENDS, _SETITEMS) or op in _TAKE_MARK:
                if not marks:
                    raise TokenError("no MARK to take items from")
                holds, depth = marks.pop()  # APPENDS, SETITEMS: back to the list / dict below the MARK
                if op not in (_APPENDS, _SETITEMS):
                    holds = None
                    depth += op != _POP_MARK  # the tuple, list, ... made of the items
                top = below = None
            elif op == _STOP:
                p = end
                break
            elif op in _PUTS:
                holds = None
                idx = self._index(p, end, _PUTS[op])
                if idx > self.count:
                    raise TokenError(f"memo entry {idx} is set out of order")
                self.count += idx == self.count
                if top is None:
                    self.known.pop(idx, None)
                else:
                    self.known[idx] = top
                if self.runs:
                    self.out += data[keep:p] + self._renumbered(idx, get=False)
                    keep = end
            elif op in _STRINGS:
                top, below, holds = data[p + _STRINGS[op]:end].decode("utf-8", "surrogatepass"), top, None
                depth += 1
            elif op == _STACK_GLOBAL:
                top = ("global", below, top) if type(below) is str and type(top) is str else None
                below = holds = None
                depth -= 1
            elif op == FRAME:
                if end + int.from_bytes(data[p + 1:end], "little") > n:
                    raise TokenError("a frame runs past the end")
                self.out += data[keep:p]
                keep = end
            elif op in _PERSISTENT:
                raise TokenError("a persistent id")
            p = end
        self.out += data[keep:p]
        self._decode_chunks()
        stream, self.out = bytes(self.out), None
        return stream

    def _skip(self, start: int) -> bool:
        """Whether the list at `start` is the pickle's last value (nothing after it but SETITEMS, BUILD, STOP: the
        last key of the outermost object's state; dcp_metadata checks that object is the Metadata and NOT_READ its
        `all_local_plans`) and one self-contained value (pickle_value): then it is skipped unread, its memo entries
        counted (nothing after it reads the memo)."""
        n = len(self.data)
        if self.data[n - 3:] != b"ub.":
            return False
        memos = value_memos(self.data, start, n - 3, self.frames)
        if memos is None:
            return False
        self.count += memos
        self.skipped = True
        return True

    def _index(self, p: int, end: int, width: int) -> int:
        if width:
            return int.from_bytes(self.data[p + 1:end], "little")
        return int(self.data[p + 1:end - 1])

    def _literals(self, m, names: dict) -> tuple | None:
        """The memo lookups a probed record made, if each names what it must (by the tracked values)."""
        out = []
        for name, expected in names.items():
            raw = m.group(name)
            idx = raw[1] if raw[0] == ord("h") else int.from_bytes(raw[1:], "little")
            if self.known.get(idx) != expected:
                return None
            out.append((name, raw))
        return tuple(out)

    def _cut(self, start: int, kind: str, single: bool):
        """At an item of a `chunks` list or a key of a `storage_data` dict (records from `start`): (where to go on,
        what stands in their place) for a run of chunk or storage records up to the APPENDS / SETITEMS that takes
        them (`single`: one record and the APPEND / SETITEM after it, which the stand-in includes); None where
        there is none."""
        data = self.data
        if kind == "chunks":
            m = PROBE_CHUNK.match(data, start)
            if not m:
                return None
            literals = self._literals(m, CHUNK_NAMES)
            nd = next(k for k in range(4) if m.group(f"n{k}") is not None)
        else:
            m = PROBE_STORAGE.match(data, start)
            if not m:
                return None
            literals, nd = self._literals(m, STORAGE_NAMES), None
        if literals is None:
            return None
        closer = _CLOSERS[kind, single]
        # Each match of a scanner starts where the last ended (re.Scanner's primitive): the run's records in a row.
        scanner = run_pattern(kind, literals, nd).scanner(data, start)
        ends = np.fromiter((r.end() for r in iter(scanner.match, None)), dtype=np.int64)
        resume = int(ends[-1])
        if data[resume:resume + 1] != bytes([closer]):
            if not single:
                self.no_cut_before = resume
            return None
        if (single and len(ends) > 1) or not self._frames_in(start, ends):
            return None
        starts = np.concatenate([[start], ends[:-1]]).astype(np.int64)
        if kind == "chunks":
            rows = Rows(kind, self.chunk_rows, self.chunk_rows + len(starts))
            self.chunk_groups.setdefault(nd, []).append((starts, self.chunk_rows))
            self.chunk_rows = rows.stop
            record_memos = self.count + chunk_memos(nd) * np.arange(len(starts), dtype=np.int64)
            size = chunk_memos(nd) * len(starts)
        else:
            fields = self._storage(decode_storage(self.u8, starts))
            if fields is None:
                return None
            rows = Rows(kind, self.storage_rows, self.storage_rows + len(starts))
            self.storage_rows = rows.stop
            record_memos = self.count + np.concatenate([[0], np.cumsum(fields["memos"])[:-1]]).astype(np.int64)
            size = int(fields["memos"].sum())
            fields["record_memos"] = record_memos
            self.storage_parts.append(fields)
        self.runs.append(_Run(self.count, size, rows, record_memos, None if kind == "chunks" else
                              len(self.storage_parts) - 1))
        self.run_memos.append(self.count)
        self.cut_before.append(self.cut_before[-1] + size)
        self.count += size
        marker = self._persistent(rows) + (b"N" if kind == "storage" else b"")  # storage: None as the key's value
        return (resume + 1, marker + bytes([closer])) if single else (resume, marker)

    def _frames_in(self, start: int, ends: np.ndarray) -> bool:
        """Whether every stripped frame header inside the records `start:ends[-1]` was where an opcode starts."""
        lo, hi = bisect_right(self.frames, start), bisect_right(self.frames, int(ends[-1]) - 1)
        for at in self.frames[lo:hi]:
            r = int(np.searchsorted(ends, at, side="right"))
            q = start if r == 0 else int(ends[r - 1])
            while q < at:
                q = token_end(self.data, q)
            if q != at:
                return False
        return True

    def _string_id(self, text) -> int:
        if type(text) is not str:
            raise KeyError(text)
        return self.string_ids.setdefault(text, len(self.string_ids))

    def _storage(self, f: dict) -> dict | None:
        """The records' fqn and path as string ids (spelled out, or memo lookups resolved), or None where one is
        not a str."""
        try:
            for name in ("fqn", "path"):
                ids = np.zeros(len(f["memos"]), dtype=np.int64)
                literal = f[f"{name}_literal"]
                if literal.any():
                    lengths, at = f[f"{name}_len"][literal], f[f"{name}_at"][literal]
                    cols = np.arange(int(lengths.max()))
                    raw = self.u8[np.minimum(at[:, None] + cols, len(self.u8) - 1)] * (cols < lengths[:, None])
                    rows = np.ascontiguousarray(np.column_stack([lengths.astype(np.uint8), raw]))
                    unique, inverse = np.unique(rows.view(np.dtype((np.void, rows.shape[1]))).ravel(),
                                                return_inverse=True)
                    made = [self._string_id(row.tobytes()[1:1 + row.tobytes()[0]].decode("utf-8", "surrogatepass"))
                            for row in unique]
                    ids[literal] = np.asarray(made, dtype=np.int64)[inverse.reshape(-1)]
                if not literal.all():
                    gets, inverse = np.unique(f[f"{name}_get"][~literal], return_inverse=True)
                    ids[~literal] = np.asarray([self._string_at(int(i)) for i in gets],
                                               dtype=np.int64)[inverse.reshape(-1)]
                f[name] = ids
        except (KeyError, UnicodeDecodeError):
            return None
        for name in ("fqn", "path"):  # where the strings were: read now
            del f[f"{name}_len"], f[f"{name}_at"], f[f"{name}_get"]
        return f

    def _string_at(self, idx: int) -> int:
        """The string id of memo entry `idx`: a tracked str, or a fqn or path an earlier storage record spelled out."""
        if idx in self.known:
            return self._string_id(self.known[idx])
        i, run = self._run_of(idx)
        if run is None or run.part is None or idx >= run.memo + run.size:
            raise KeyError(idx)
        part = self.storage_parts[run.part]
        r = int(np.searchsorted(part["record_memos"], idx, side="right")) - 1
        entry = idx - int(part["record_memos"][r])
        if part["fqn_literal"][r] and entry == 2:
            return int(part["fqn"][r])
        if part["path_literal"][r] and entry == part["memos"][r] - 1:
            return int(part["path"][r])
        raise KeyError(idx)

    def _decode_chunks(self) -> None:
        rec = self.records
        rec.chunk_nd = np.zeros(self.chunk_rows, dtype=np.int64)
        rec.chunk_offsets = np.zeros((self.chunk_rows, 3), dtype=np.int64)
        rec.chunk_sizes = np.zeros((self.chunk_rows, 3), dtype=np.int64)
        for nd, parts in self.chunk_groups.items():
            starts = np.concatenate([s for s, _ in parts])
            rows = np.concatenate([first + np.arange(len(s)) for s, first in parts])
            offsets, sizes = decode_chunks(self.u8, starts, nd)
            rec.chunk_nd[rows] = nd
            rec.chunk_offsets[rows, :nd], rec.chunk_sizes[rows, :nd] = offsets, sizes
        parts = [_no_storage()] + self.storage_parts
        rec.storage = {k: np.concatenate([p[k] for p in parts]) for k in _STORAGE_FIELDS}
        for part in self.storage_parts:  # the records hold these now; stand_in reads the rest
            for k in _STORAGE_FIELDS:
                del part[k]
        rec.storage["index"][rec.storage["index_none"]] = -1
        rec.strings = list(self.string_ids)

    # -- what a persistent id in the rewritten stream stands for ---------------------------------------------------
    def stand_in(self, pid: int):
        what = self.markers[pid]
        if isinstance(what, Rows) or what is NOT_READ:
            return what
        _, i, offset = what
        run = self.runs[i]
        r = int(np.searchsorted(run.record_memos, run.memo + offset, side="right")) - 1
        entry = run.memo + offset - int(run.record_memos[r])
        row = run.rows.start + r
        if run.rows.kind == "chunks":
            chunk = self.records.chunk(row)
            return ([chunk, dict(chunk.__dict__)] + _size_entries(chunk.offsets) + _size_entries(chunk.sizes))[entry]
        key, info = self.records.storage_entry(row)
        part = self.storage_parts[run.part]
        entries = ([key, dict(key.__dict__)] + ([key.fqn] if part["fqn_literal"][r] else [])
                   + _size_entries(key.offset) + [info, dict(info.__dict__)]
                   + ([info.relative_path] if part["path_literal"][r] else []))
        return entries[entry]


def rewrite(data: bytes):
    """(the pickle with its record runs cut out, the records as arrays, what each persistent id stands for, how
    many runs were cut, whether `all_local_plans` was skipped: NOT_READ stands for it)."""
    w = _Rewriter(data)
    stream = w.run()
    w.data = w.u8 = None  # stand_in needs the arrays only: the caller can let go of the 400 MB file at 671B
    return stream, w.records, w.stand_in, len(w.runs), w.skipped
