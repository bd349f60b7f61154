"""Megatron-LM legacy checkpoints (`--ckpt-format torch`): `mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`.

Each file is one (TP, PP, EP) rank's `torch.save` of `{"model" | "model0", "model1"..., "args", ...}` with
layer numbers local to its pipeline chunk and expert numbers local to its EP rank. The catalog reads the
lowest-TP-rank file of every (PP, EP) slice (memory-mapped: no tensor bytes) and describes the canonical
global tensors: layers renumbered in (virtual stage, stage) order (a VLM's text model's too, its tower being one
chunk's, whole), experts as ep * local_count + local under
SequentialMLP's names whichever module saved them (GroupedMLP, TEGroupedMLP), TP shards placed as pieces
(split along the dim megatron_tp.py gives, or whole as one piece with a copy in every file);
experts are split by expert TP instead, which may differ from TP. A gated fc1 holds [gate_r; up_r] per TP
rank (a Mamba2 in_proj [z_r; x_r; B_r; C_r; dt_r], a Gated DeltaNet's [q_r; k_r; v_r; z_r; b_r; a_r]:
megatron_sections.py), so each
section is its own piece placed in its whole section (cat(gate, up)): the global tensor then reads the same as
torch_dist's. Entries that are not weights are left out by the named rules of megatron_skips.py.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import types
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored
from ..errors import MergerError, SourceError
from .mapped_states import MappedStates
from .piece_keys import split_expert, split_key, take, take_expert, with_expert, with_slice
from .megatron_dist import VLM_PREFIXES
from .megatron_skips import NOT_A_TENSOR, skip_rule
from .megatron_layout import checkpoint_dir
from .megatron_sections import local_sections
from .megatron_tp import tp_dim
from .safe_load import check_zip_end, torch_load

FILE = "model_optim_rng.pt"
MP_DIR = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")
TEXT = VLM_PREFIXES[0]  # a VLM's text model, a GPTModel: language_model.*
# a GPTModel's layers, or a VLM's text model's (which are pipelined as a GPTModel's are); a tower's are not matched
LAYER = re.compile(rf"((?:{re.escape(TEXT)})?decoder\.layers\.)(\d+)\.(.*)")
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")
GROUPED = re.compile(r"(.*\.mlp\.experts\.)weight([12])")  # GroupedMLP: all local experts in one matrix
TE_GROUPED = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)")  # TEGroupedMLP


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


def _rank_files(ckpt: Path) -> tuple[dict[tuple[int, int, int], str], argparse.Namespace | None]:
    """(tp, pp, ep) -> file, and the first file's args. One suffix means PP or EP: the args decide (PP
    without args)."""
    found = {}
    for d in ckpt.iterdir():
        m = MP_DIR.fullmatch(d.name)
        if m and (d / FILE).is_file():
            found[d.name] = (int(m.group(1)), [int(x) for x in m.group(2).split("_")[1:]], str(d / FILE))
    if not found:
        raise SourceError(f"no mp_rank_*/{FILE} files, {ckpt}")
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
    return files, args


def _layout(files: dict[tuple[int, int, int], str], args, ckpt: Path) -> tuple[tuple[int, int, int, int], dict]:
    """(TP, PP, EP, ETP) and each file's expert tensor-parallel rank, checking that no file is missing.

    Megatron-LM's expert-DP rank 0 writes the legacy files. Within a pipeline stage, rank r holds attention's
    TP rank r % TP, and with experts laid out ETP-fastest, EP rank r // ETP and expert TP rank r % ETP; the
    writers are r < ETP x EP. ETP = TP (the default, and every Megatron before ETP) gives the whole TP x EP
    grid; TP2 EP2 ETP1 gives `mp_rank_00_000` and `mp_rank_01_001` only.
    """
    declared = [getattr(args, f"{n}_model_parallel_size", None) for n in ("tensor", "pipeline", "expert")]
    tp_size, pp_size, ep_size = (d or 1 + max(k[i] for k in files) for i, d in enumerate(declared))
    etp_size = getattr(args, "expert_tensor_parallel_size", None) or tp_size
    writers = {(r % tp_size, r // etp_size): r % etp_size for r in range(etp_size * ep_size)}
    if len(writers) < etp_size * ep_size or etp_size * ep_size < tp_size:
        raise MergerError(f"with TP {tp_size}, EP {ep_size} and expert TP {etp_size}, Megatron-LM's legacy files "
                          f"{'overwrite each other' if len(writers) < etp_size * ep_size else 'leave TP ranks out'}"
                          f": save this layout as torch_dist, {ckpt}")
    for pp in range(pp_size):
        for (tp, ep) in sorted(writers, key=lambda k: (k[1], k[0])):
            if (tp, pp, ep) not in files:
                raise SourceError(f"rank file for tp {tp} pp {pp} ep {ep} is missing ({tp_size} x {pp_size} x "
                                  f"{ep_size} expected, expert TP {etp_size}), {ckpt}")
    for (tp, pp, ep), file in files.items():
        if (tp, ep) not in writers or pp >= pp_size:
            raise MergerError(f"rank file for tp {tp} pp {pp} ep {ep} does not belong to a {tp_size} x {pp_size} x "
                              f"{ep_size} layout with expert TP {etp_size}, {file}")
    return (tp_size, pp_size, ep_size, etp_size), {files[(tp, pp, ep)]: etp for (tp, ep), etp in writers.items()
                                                     for pp in range(pp_size)}


def _pieces(local: torch.Tensor, dim: int | None, sections: tuple[int, ...] | None,
            copies: dict[int, list[PieceCopy]], tp_size: int):
    """Global shape and pieces of one tensor from its rank-0 local shape and every rank's copies (`tp_size`
    ranks: TP, or expert TP for experts); a shard of several `sections` (megatron_sections.py) gives a piece per
    section, placed in the whole section."""
    shape = list(local.shape)
    if dim is None:
        every = tuple(c for tp in sorted(copies) for c in copies[tp])
        return tuple(shape), (ShardPiece((0,) * len(shape), tuple(shape), every),)
    size = shape[dim]
    shape[dim] *= tp_size
    pieces = []
    for tp in range(tp_size):
        if sections is None:
            offsets = [0] * len(shape)
            offsets[dim] = tp * size
            pieces.append(ShardPiece(tuple(offsets), tuple(local.shape), tuple(copies[tp])))
            continue
        start = 0  # in this rank's shard; the whole section j starts at start * tp_size
        for rows in sections:
            offsets = (start * tp_size + tp * rows,) + (0,) * (len(shape) - 1)
            keyed = tuple(PieceCopy(c.file, with_slice(c.key, start, start + rows)) for c in copies[tp])
            pieces.append(ShardPiece(offsets, (rows, *local.shape[1:]), keyed))
            start += rows
    return tuple(shape), tuple(pieces)


def _local_weights(chunk: dict, experts: int | None, file: str) -> tuple[dict[str, tuple[torch.Tensor, str]], dict]:
    """One model chunk's weights under SequentialMLP's names, each as (its local tensor or view, its locator),
    and what the skip rules leave out (name -> rule). GroupedMLP's `experts.weight1/2` become one view per
    local expert (piece_keys.py); TEGroupedMLP's `experts.linear_fc1.weight{i}` is local expert i's
    weight as SequentialMLP saves it, renamed."""
    weights, skipped = {}, {}
    for name, value in chunk.items():
        rule = skip_rule(name) or (None if isinstance(value, torch.Tensor) else NOT_A_TENSOR)
        if rule:
            skipped[name] = rule
        elif m := GROUPED.fullmatch(name):
            if not experts:
                raise MergerError(f"GroupedMLP tensor {name} needs the expert count, which this file's args do "
                                  f"not give (num_experts), {file}")
            rows, cols = value.shape if value.dim() == 2 else (0, 0)
            view = (experts, rows, cols // experts) if m.group(2) == "1" else (experts, rows // experts, cols)
            if view[1] * view[2] * experts != value.numel() or not value.is_contiguous() or not value.numel():
                raise MergerError(f"GroupedMLP tensor {name} of shape {tuple(value.shape)} does not hold "
                                  f"{experts} local experts, {file}")
            for e in range(experts):
                weights[f"{m.group(1)}local_experts.{e}.linear_fc{m.group(2)}.weight"] = (
                    take_expert(value, (view, e)), with_expert(name, view, e))
        elif m := TE_GROUPED.fullmatch(name):
            weights[f"{m.group(1)}local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}"] = (value, name)
        else:
            weights[name] = (value, name)
    return weights, skipped


def open_catalog(root: Path) -> Catalog:
    ckpt, hf_dir = checkpoint_dir(root)
    files, args = _rank_files(ckpt)
    (tp_size, pp_size, ep_size, etp_size), etp_of = _layout(files, args, ckpt)
    experts = getattr(args, "num_experts", None)
    local_experts = experts // ep_size if experts else None
    first = {pp: load_file(files[(0, pp, 0)]) for pp in range(pp_size)}
    chunk_keys = _chunks(first[0])

    # Global layer number of every (chunk, stage, local layer): chunks hold contiguous layers in (vp, pp) order.
    # A VLM's text model is pipelined as a GPTModel is, its layers numbered from 0 in every chunk too.
    offsets, count = {}, 0
    for vp, key in enumerate(chunk_keys):
        for pp in range(pp_size):
            layers = {int(m.group(2)) for n in first[pp][key] if (m := LAYER.fullmatch(n))}
            offsets[(vp, pp)] = count
            count += len(layers)

    def global_name(name: str, vp: int, pp: int, ep: int, per_rank: int) -> str:
        if m := LAYER.fullmatch(name):
            name = f"{m.group(1)}{offsets[(vp, pp)] + int(m.group(2))}.{m.group(3)}"
        if m := EXPERT.fullmatch(name):
            name = f"{m.group(1)}{ep * per_rank + int(m.group(2))}{m.group(3)}"
        return name

    entries: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    towers: dict[tuple[int, int], set[str]] = {}  # (vp, pp) -> the names beside a VLM's text model in that chunk
    for pp in range(pp_size):
        for ep in range(ep_size):
            # The slice's experts are read from the file of its lowest TP rank; every file of the slice is a copy.
            slice_files = sorted((tp, f) for (tp, p, e), f in files.items() if (p, e) == (pp, ep))
            reference = slice_files[0][1]
            state = first[pp] if reference == files[(0, pp, 0)] else load_file(reference)
            for vp, key in enumerate(chunk_keys):
                local, left_out = _local_weights(state[key], local_experts, reference)
                shapes = {n: tuple(v.shape) for n, (v, _) in local.items()}
                per_rank = len({int(m.group(2)) for n in local if (m := EXPERT.fullmatch(n))})
                if any(n.startswith(TEXT) for n in local):
                    towers.setdefault((vp, pp), set()).update(n for n in local if not n.startswith(TEXT))
                skipped.update({global_name(n, vp, pp, ep, per_rank): rule for n, rule in left_out.items()})
                for name, (value, stored) in local.items():
                    g = global_name(name, vp, pp, ep, per_rank)
                    expert = EXPERT.fullmatch(name) is not None
                    entry = entries.setdefault(g, {"value": value, "copies": {},
                                                   "sections": local_sections(name, shapes, reference),
                                                   "dim": tp_dim(name, tuple(value.shape), shapes),
                                                   "ranks": etp_size if expert else tp_size})
                    if tuple(entry["value"].shape) != tuple(value.shape):
                        raise MergerError(f"tensor {name} differs in shape between EP ranks, {reference}")
                    # Experts are split by expert TP: each file holds its expert TP rank's part. The rest is
                    # split by TP, and repeats in every EP rank's file.
                    for tp, file in slice_files:
                        rank = etp_of[file] if expert else tp
                        entry["copies"].setdefault(rank, []).append(PieceCopy(file, f"{key}/{stored}"))
    # Megatron-Bridge's VLMs (Qwen3VLModel, GLM45VModel) build the tower on the first chunk of the first stage alone
    # (pre_process), whole, its layers numbered as one block, so its names are global as they stand. A tower held by
    # several chunks would number its layers per chunk, which no rule here renumbers.
    if len(held := sorted(c for c, names in towers.items() if names)) > 1:
        raise MergerError(f"a Megatron vision-language checkpoint whose vision tower is split over pipeline chunks "
                          f"{', '.join(f'(stage {pp}, chunk {vp})' for vp, pp in held)}: merger reads a tower saved "
                          f"whole by one stage, as Megatron-Bridge's VLMs save it (docs/megatron.md), {ckpt}")
    tensors = {}
    for g, entry in entries.items():
        shape, pieces = _pieces(entry["value"], entry["dim"], entry["sections"], entry["copies"],
                                entry["ranks"])
        tensors[g] = SourceTensor(g, shape, entry["value"].dtype, pieces)
    ordered = [files[k] for k in sorted(files, key=lambda k: (k[1], k[2], k[0]))]
    return Catalog(
        format="megatron_legacy", naming="megatron", root=root, tensors=tensors, files=ordered,
        reader_factory=LegacyReader, hf_dir=hf_dir, skipped=skipped, check_file=check_zip_end,
        details={"checkpoint": str(ckpt), "tp": tp_size, "pp": pp_size, "ep": ep_size, "expert_tp": etp_size,
                 "virtual_chunks": len(chunk_keys), "layers": count})


class LegacyReader:
    """Locates TP-local tensors (or a section of one: a half of a gated fc1) in the rank files."""

    def __init__(self, catalog: Catalog):
        self.states = MappedStates(load_file)

    def check_files(self, files: list[str]) -> None:
        for file in files:
            self.states[file]  # loads and checks it

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        key, sl = split_key(copy.key)
        key, grouped = split_expert(key)
        chunk, name = key.split("/", 1)
        value = self.states[copy.file][chunk].get(name)
        if not isinstance(value, torch.Tensor):
            raise MergerError(f"tensor {name} is missing from this rank's file, {copy.file}")
        return self.states.stored(copy.file, take(take_expert(value, grouped), sl))
