"""Megatron-LM legacy checkpoints (`--ckpt-format torch`): `mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`.

Each file is one (TP, PP, EP) rank's `torch.save` of `{"model" | "model0", "model1"..., "args", ...}` with
layer numbers local to its pipeline chunk and expert numbers local to its EP rank. The catalog reads the
TP-rank-0 file of every (PP, EP) slice (memory-mapped: no tensor bytes) and describes the canonical
global tensors: layers renumbered in (virtual stage, stage) order, experts as ep * local_count + local,
TP shards placed as pieces (column-parallel along dim 0, row-parallel along dim 1, replicated as one piece
with a copy in every file). A gated fc1 holds [gate_r; up_r] per TP rank, so each half is its own piece
placed in cat(gate, up): the global fc1 then reads the same as torch_dist's.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import types
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from ..errors import MergerError
from .file_reads import Stored
from .mapped_states import MappedStates
from .megatron_keys import split_key, take, with_slice
from .megatron_layout import checkpoint_dir
from .safe_load import torch_load

FILE = "model_optim_rng.pt"
MP_DIR = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_up_proj.weight", "eh_proj.weight")
# MLA's down projections: column-parallel in the local spec, whole on every rank in TE's (a TELinear, with the
# q/kv norms fused into the up projections, so `linear_kv_up_proj.layer_norm_weight` marks a TE layer).
MLA_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def detect(root: Path) -> bool:
    ckpt, _ = checkpoint_dir(root)
    return ckpt.is_dir() and any((p / FILE).is_file() for p in ckpt.glob("mp_rank_*"))


# `args` is an argparse.Namespace and TE's `_extra_state` may be a BytesIO. Megatron-LM's args may also
# hold megatron-core enums and configs: megatron-core lists those in SAFE_GLOBALS, imported (slow) only
# when a file needs them.
_BASIC = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO]


def _megatron_globals() -> list:
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        return []
    return list(SAFE_GLOBALS)


def load_file(path: str) -> dict:
    try:
        state = torch_load(path, "Megatron rank file", safe_globals=tuple(_BASIC))
    except MergerError:
        extra = _megatron_globals()  # the slow import, only for files that name megatron-core's classes
        if not extra:
            raise
        state = torch_load(path, "Megatron rank file", safe_globals=tuple(_BASIC + extra))
    if not isinstance(state, dict) or not _chunks(state):
        raise MergerError(f"file holds no `model` state dict, {path}")
    return state


def _chunks(state: dict) -> list[str]:
    """`model`, or `model0`, `model1`... (one per virtual pipeline chunk), in chunk order."""
    if isinstance(state.get("model"), dict):
        return ["model"]
    keys = [k for k in state if re.fullmatch(r"model\d+", str(k)) and isinstance(state[k], dict)]
    return sorted(keys, key=lambda k: int(k[5:]))


def _rank_files(ckpt: Path) -> dict[tuple[int, int, int], str]:
    """(tp, pp, ep) -> file. One suffix means PP or EP: the args of the first file decide (PP without args)."""
    found = {}
    for d in ckpt.iterdir():
        m = MP_DIR.fullmatch(d.name)
        if m and (d / FILE).is_file():
            found[d.name] = (int(m.group(1)), [int(x) for x in m.group(2).split("_")[1:]], str(d / FILE))
    if not found:
        raise MergerError(f"no mp_rank_*/{FILE} files, {ckpt}")
    first = next(iter(found.values()))[2]
    args = load_file(first).get("args")
    pp_size = getattr(args, "pipeline_model_parallel_size", None)
    files = {}
    for name, (tp, suffix, path) in found.items():
        if len(suffix) == 2:
            pp, ep = suffix
        elif len(suffix) == 1:
            ep_only = pp_size == 1 and getattr(args, "expert_model_parallel_size", 1) > 1
            pp, ep = (0, suffix[0]) if ep_only else (suffix[0], 0)
        else:
            pp, ep = 0, 0
        files[(tp, pp, ep)] = path
    # The args name the layout when present, so a whole missing TP/PP/EP slice is caught too.
    declared = [getattr(args, f"{n}_model_parallel_size", None) for n in ("tensor", "pipeline", "expert")]
    sizes = [d or 1 + max(k[i] for k in files) for i, d in enumerate(declared)]
    for tp in range(sizes[0]):
        for pp in range(sizes[1]):
            for ep in range(sizes[2]):
                if (tp, pp, ep) not in files:
                    raise MergerError(f"rank file for tp {tp} pp {pp} ep {ep} is missing ({sizes[0]} x {sizes[1]} x "
                                      f"{sizes[2]} expected), {ckpt}")
    return files


def _is_gated(local: dict[str, torch.Tensor], name: str) -> bool:
    """fc1 is [gate; up] when it has twice the rows fc2 has columns (Megatron does not record it)."""
    fc2 = local.get(name.replace("linear_fc1.weight", "linear_fc2.weight"))
    return name.endswith("linear_fc1.weight") and fc2 is not None and local[name].shape[0] == 2 * fc2.shape[1]


def _tp_dim(local: dict[str, torch.Tensor], name: str) -> int | None:
    """The dim a tensor is split along over TP ranks (None: replicated)."""
    if name == "output_layer.weight" and local[name].shape[0] == 1:
        return None  # a critic's value head: a replicated Linear(hidden, 1), not a vocab-parallel layer
    if name.endswith(MLA_DOWN):
        fused_norm = name.rsplit(".", 2)[0] + ".linear_kv_up_proj.layer_norm_weight"
        return None if fused_norm in local else 0
    return 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None


def _pieces(local: torch.Tensor, dim: int | None, gated: bool, copies: dict[int, list[PieceCopy]], tp_size: int):
    """Global shape and pieces of one tensor from its TP-rank-0 local shape and every rank's copies."""
    shape = list(local.shape)
    if dim is None:
        every = tuple(c for tp in sorted(copies) for c in copies[tp])
        return tuple(shape), (ShardPiece((0,) * len(shape), tuple(shape), every),)
    size = shape[dim]
    shape[dim] *= tp_size
    pieces = []
    for tp in range(tp_size):
        if not gated:
            offsets = [0] * len(shape)
            offsets[dim] = tp * size
            pieces.append(ShardPiece(tuple(offsets), tuple(local.shape), tuple(copies[tp])))
            continue
        half = size // 2
        for j in range(2):  # j = 0: this rank's gate rows, j = 1: its up rows
            sizes = (half, *local.shape[1:])
            offsets = (j * half * tp_size + tp * half,) + (0,) * (len(shape) - 1)
            keyed = tuple(PieceCopy(c.file, with_slice(c.key, j * half, (j + 1) * half)) for c in copies[tp])
            pieces.append(ShardPiece(offsets, sizes, keyed))
    return tuple(shape), tuple(pieces)


def open_catalog(root: Path) -> Catalog:
    ckpt, hf_dir = checkpoint_dir(root)
    files = _rank_files(ckpt)
    tp_size, pp_size, ep_size = (1 + max(k[i] for k in files) for i in range(3))
    first = {pp: load_file(files[(0, pp, 0)]) for pp in range(pp_size)}
    chunk_keys = _chunks(first[0])

    # Global layer number of every (chunk, stage, local layer): chunks hold contiguous layers in (vp, pp) order.
    offsets, count = {}, 0
    for vp, key in enumerate(chunk_keys):
        for pp in range(pp_size):
            layers = {int(m.group(1)) for n in first[pp][key] if (m := LAYER.fullmatch(n))}
            offsets[(vp, pp)] = count
            count += len(layers)

    entries: dict[str, dict] = {}
    for pp in range(pp_size):
        for ep in range(ep_size):
            state = first[pp] if ep == 0 else load_file(files[(0, pp, ep)])
            for vp, key in enumerate(chunk_keys):
                local = {n: v for n, v in state[key].items()
                         if isinstance(v, torch.Tensor) and not n.endswith("_extra_state")}
                experts = {int(m.group(2)) for n in local if (m := EXPERT.fullmatch(n))}
                for name, value in local.items():
                    g = name
                    if m := LAYER.fullmatch(g):
                        g = f"decoder.layers.{offsets[(vp, pp)] + int(m.group(1))}.{m.group(2)}"
                    if m := EXPERT.fullmatch(g):
                        g = f"{m.group(1)}{ep * len(experts) + int(m.group(2))}{m.group(3)}"
                    entry = entries.setdefault(g, {"value": value, "gated": _is_gated(local, name),
                                                   "dim": _tp_dim(local, name), "copies": {}})
                    if tuple(entry["value"].shape) != tuple(value.shape):
                        raise MergerError(f"tensor {name} differs in shape between EP ranks, {files[(0, pp, ep)]}")
                    for tp in range(tp_size):
                        entry["copies"].setdefault(tp, []).append(PieceCopy(files[(tp, pp, ep)], f"{key}/{name}"))
    tensors = {}
    for g, entry in entries.items():
        shape, pieces = _pieces(entry["value"], entry["dim"], entry["gated"], entry["copies"], tp_size)
        tensors[g] = SourceTensor(g, shape, entry["value"].dtype, pieces)
    ordered = [files[k] for k in sorted(files, key=lambda k: (k[1], k[2], k[0]))]
    return Catalog(
        format="megatron_legacy", naming="megatron", root=root, tensors=tensors, files=ordered,
        reader_factory=LegacyReader, hf_dir=hf_dir,
        details={"checkpoint": str(ckpt), "tp": tp_size, "pp": pp_size, "ep": ep_size,
                 "virtual_chunks": len(chunk_keys), "layers": count})


class LegacyReader:
    """Locates TP-local tensors (or a half of a gated fc1) in the rank files."""

    def __init__(self, catalog: Catalog):
        self.states = MappedStates(load_file)

    def check_files(self, files: list[str]) -> None:
        for file in files:
            self.states[file]  # loads and checks it

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        key, sl = split_key(copy.key)
        chunk, name = key.split("/", 1)
        value = self.states[copy.file][chunk].get(name)
        if not isinstance(value, torch.Tensor):
            raise MergerError(f"tensor {name} is missing from this rank's file, {copy.file}")
        return self.states.stored(copy.file, take(value, sl))
