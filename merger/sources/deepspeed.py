"""DeepSpeed ZeRO checkpoints (stage 1, 2, 3): the fp32 master weights, read out of the ranks' flat partitions.

`engine.save_checkpoint(dir, tag)` writes `dir/latest` (the tag) and `dir/<tag>/`; HF Trainer puts the same
into `checkpoint-N/` beside config.json and the tokenizer. In `<tag>/`, model_states files hold `param_shapes`
(one ordered dict per param group), the frozen params, `shared_params` (tied names) and the buffers; each
rank's `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` holds its slice of every group as one flat fp32
tensor. A param's place follows from the shapes alone, by the rules DeepSpeed's zero_to_fp32 applies:
- stage 1/2: group g's full vector is the ranks' slices end to end; its params lie there in order, each
  followed by its alignment padding (`param_alignment_paddings`), the group padded at its end;
- stage 3: every param is cut into `ceil(numel / W)` elements per rank (the last rank's part padded); rank r
  holds part r of each param in order, across its groups as if they were one vector. Frozen params are cut
  the same way, into each rank's own model_states file.
Each param becomes a catalog tensor whose pieces are the runs it has in each rank's file, so every merge rank
reads only the bytes of the files it opened.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch

from ..catalog import Catalog, PieceCopy, ShardPiece, SourceTensor, Stored, row_major_index
from ..errors import MergerError, SourceError
from ..hf_folder import config_dir, named_file
from .deepspeed_states import load_states
from .flat_runs import run_boxes
from .mapped_states import MappedStates
from .safe_load import check_zip_end

OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
PIPELINE_FILE = re.compile(r"layer_\d+-model_\d+-model_states\.pt|layer_\d+-model_states\.pt")
EXPERT_FILE = re.compile(r".*expert.*_model_states\.pt")  # MoE: `layer_{l}_expert_{e}_mp_rank_00_model_states.pt`
FLAT_GROUPS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups", 3: "fp32_flat_groups"}


def step_dir(root: Path) -> Path | None:
    """The folder holding the state files: `root` itself, or the tag its `latest` file names."""
    if any(OPTIM_FILE.fullmatch(p.name) for p in root.glob("*_optim_states.pt")):
        return root
    latest = root / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        if tag not in ("", ".", "..") and "/" not in tag and (root / tag).is_dir():
            return named_file(root, tag, latest)  # the tag's folder, a link out of the checkpoint refused
    return None


def detect(root: Path) -> bool:
    step = step_dir(root)
    return step is not None and any(OPTIM_FILE.fullmatch(p.name) for p in step.glob("*_optim_states.pt"))


def _refuse_model_parallel(step: Path) -> None:
    for p in sorted(step.iterdir()):
        m = OPTIM_FILE.fullmatch(p.name) or MODEL_FILE.fullmatch(p.name)
        if m and int(m.groups()[-1]) != 0:
            raise MergerError(f"model-parallel DeepSpeed checkpoint (tensor-parallel rank {int(m.groups()[-1])}): "
                              f"merger reads data-parallel ZeRO checkpoints only (mp_rank_00), {p}")
        if PIPELINE_FILE.fullmatch(p.name):
            raise MergerError(f"pipeline-parallel DeepSpeed checkpoint (per-layer model_states): merger reads "
                              f"data-parallel ZeRO checkpoints only, {p}")
        if EXPERT_FILE.fullmatch(p.name):
            raise MergerError(f"DeepSpeed MoE checkpoint (experts saved in files of their own): merger reads "
                              f"data-parallel ZeRO checkpoints only, {p}")


def _optim_files(step: Path) -> list[str]:
    ranks = {int(m.group(2)): p for p in step.iterdir() if (m := OPTIM_FILE.fullmatch(p.name))}
    missing = [r for r in range(max(ranks) + 1) if r not in ranks]
    if missing:
        raise SourceError(f"optim_states of rank {missing[0]} is missing ({len(ranks)} rank files for ranks up to "
                          f"{max(ranks)}), {step}")
    return [str(ranks[r]) for r in range(len(ranks))]


def _model_files(step: Path, stage: int, world: int) -> list[str]:
    names = ["mp_rank_00_model_states.pt"] if stage < 3 else [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    for name in names:
        if not (step / name).is_file():
            raise SourceError(f"model_states of a stage {stage} checkpoint is missing, {step / name}")
    return [str(step / name) for name in names]


def _optimizer_state(state: dict, file: str) -> dict:
    opt = state.get("optimizer_state_dict")
    if not isinstance(opt, dict) or "zero_stage" not in opt:
        raise MergerError(f"optim_states holds no ZeRO optimizer state, {file}")
    return opt


def _stage_and_world(opt: dict, file: str) -> tuple[int, int]:
    stage = int(opt["zero_stage"])
    if stage not in FLAT_GROUPS:
        raise MergerError(f"ZeRO stage {stage} has no partitioned fp32 weights to merge, {file}")
    counts = opt.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or any(type(c) is not int for c in counts) or len(set(counts)) != 1:
        # per-group partition counts differ when experts are data-parallel over fewer ranks (MoE)
        raise MergerError(f"param groups partitioned over different rank counts {counts} (expert parallelism?): "
                          f"merger reads plain data-parallel ZeRO checkpoints only, {file}")
    return stage, counts[0]


def _flat_groups(opt: dict, stage: int, file: str) -> list[torch.Tensor]:
    groups = opt.get(FLAT_GROUPS[stage])
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, torch.Tensor) and g.dim() == 1 and g.dtype == torch.float32 for g in groups):
        raise MergerError(f"optim_states has no list of flat fp32 tensors under {FLAT_GROUPS[stage]}, {file}")
    return list(groups)


def _partition_numels(opt: dict, stage: int, file: str) -> list[int]:
    """Each group's partition size. Stage 1/2 save the last rank's partition without the group's end padding
    (`group_paddings`, 0 on the other ranks), so sizes plus paddings are every rank's, and rank r's partition
    starts at r times that in the group's full vector."""
    sizes = [g.numel() for g in _flat_groups(opt, stage, file)]
    paddings = opt.get("group_paddings") if stage < 3 else None
    if paddings is None:
        return sizes
    if not (isinstance(paddings, list) and len(paddings) == len(sizes) and all(type(p) is int for p in paddings)):
        raise MergerError(f"group_paddings is not one count per param group, {file}")
    return [n + p for n, p in zip(sizes, paddings)]


def _shape_groups(model: dict, file: str) -> list[dict[str, tuple[int, ...]]]:
    groups = model.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise MergerError(f"model_states has no param_shapes (one dict per param group), {file}")
    return [{name: tuple(int(s) for s in shape) for name, shape in g.items()} for g in groups]


def _pieces(shape: tuple[int, ...], runs: list[tuple[str, str, int, int, int]]) -> tuple[ShardPiece, ...]:
    """Pieces from runs (file, `kind:name` of a flat tensor, element of it where the run starts, param elements
    [begin, end)); each piece's key adds the element of the flat tensor where the piece starts."""
    pieces = []
    for file, group, start, begin, end in runs:
        for offsets, sizes in run_boxes(shape, begin, end):
            first = row_major_index(shape, offsets)
            pieces.append(ShardPiece(offsets, sizes, (PieceCopy(file, f"{group}:{start + first - begin}"),)))
    return tuple(pieces)


def _split_at_groups(sizes: list[int], begin: int, end: int) -> list[tuple[int, int, int]]:
    """Positions [begin, end) of the groups laid end to end as (group, start in it, length) runs."""
    runs, base = [], 0
    for g, size in enumerate(sizes):
        lo, hi = max(begin, base), min(end, base + size)
        if lo < hi:
            runs.append((g, lo - base, hi - lo))
        base += size
    return runs


def _stage12_tensors(shape_groups, paddings, optim_files, part_sizes, step) -> dict[str, SourceTensor]:
    world = len(optim_files)
    tensors = {}
    if len(shape_groups) != len(part_sizes):
        raise MergerError(f"param_shapes has {len(shape_groups)} groups but the partitions {len(part_sizes)}, "
                          f"{optim_files[0]}")
    if paddings is not None and not (isinstance(paddings, list) and len(paddings) == len(shape_groups) and all(
            isinstance(g, list) and all(type(p) is int and p >= 0 for p in g) for g in paddings)):
        raise MergerError(f"param_alignment_paddings is not one list of counts per param group, {optim_files[0]}")
    for g, (shapes, part) in enumerate(zip(shape_groups, part_sizes)):
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise MergerError(f"group {g} has {len(shapes)} params but {len(pads)} alignment paddings, "
                              f"{optim_files[0]}")
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = math.prod(shape)
            runs = []
            for r in range(offset // part if part else 0, world):
                lo, hi = max(offset, r * part), min(offset + numel, (r + 1) * part)
                if lo >= hi:
                    break
                runs.append((optim_files[r], f"fp32:{g}", lo - r * part, lo - offset, hi - offset))
            if sum(hi - lo for *_, lo, hi in runs) != numel:
                raise MergerError(f"param {name} ends past the partitions of group {g} ({world} x {part} "
                                  f"elements): param_shapes and optim_states disagree, {step}")
            tensors[name] = SourceTensor(name, shape, torch.float32, _pieces(shape, runs))
            offset += numel + pad
    return tensors


def _stage3_tensors(shape_groups, optim_files, part_sizes, step) -> dict[str, SourceTensor]:
    world = len(optim_files)
    tensors, offset = {}, 0
    for shapes in shape_groups:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            per_rank = math.ceil(numel / world)
            runs = []
            for r in range(world):
                begin, end = r * per_rank, min(numel, (r + 1) * per_rank)
                at = begin
                for g, start, length in _split_at_groups(part_sizes, offset, offset + max(0, end - begin)):
                    runs.append((optim_files[r], f"fp32:{g}", start, at, at + length))
                    at += length
            tensors[name] = SourceTensor(name, shape, torch.float32, _pieces(shape, runs))
            offset += per_rank
    if offset != sum(part_sizes):
        raise MergerError(f"param_shapes give each rank {offset} elements but its partitions hold "
                          f"{sum(part_sizes)}: param_shapes and optim_states disagree, {step}")
    return tensors


def _frozen_tensors(model: dict, model_files: list[str], stage: int) -> dict[str, SourceTensor]:
    shapes = model.get("frozen_param_shapes") or {}
    fragments = model.get("frozen_param_fragments") or {}
    tensors = {}
    for name, shape in shapes.items():
        shape, value = tuple(int(s) for s in shape), fragments.get(name)
        if not isinstance(value, torch.Tensor):
            raise MergerError(f"frozen param {name} has no fragment, {model_files[0]}")
        if stage < 3:  # whole, in the one model_states file
            piece = ShardPiece((0,) * len(shape), shape, (PieceCopy(model_files[0], f"frozen:{name}:0"),))
            tensors[name] = SourceTensor(name, shape, value.dtype, (piece,))
            continue
        numel, world = math.prod(shape), len(model_files)
        per_rank = math.ceil(numel / world)
        runs = [(model_files[r], f"frozen:{name}", 0, r * per_rank, min(numel, (r + 1) * per_rank))
                for r in range(world)]
        tensors[name] = SourceTensor(name, shape, value.dtype, _pieces(shape, runs))
    return tensors


def _module_tensors(model: dict, file: str, stage: int, covered: set[str]) -> dict[str, SourceTensor]:
    """The buffers, and at stage 1/2 every param no other list holds, whole from `module` as stored.

    A stage 1 bf16 save (HF Trainer's, deepspeed 0.19.8) lists its frozen params in no frozen_param_shapes:
    zero_to_fp32 leaves them out, but `module` holds them. At stage 3 `module` holds empty placeholders.
    """
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or [])
    tensors = {}
    for name, value in module.items():
        if name in covered or not isinstance(value, torch.Tensor):
            continue
        if stage == 3 and name not in buffers:
            raise MergerError(f"param {name} is in neither param_shapes nor frozen_param_shapes, {file}")
        shape = tuple(value.shape)
        piece = ShardPiece((0,) * len(shape), shape, (PieceCopy(file, f"module:{name}:0"),))
        tensors[name] = SourceTensor(name, shape, value.dtype, (piece,))
    missing = sorted(buffers - set(tensors) - covered)
    if missing:
        raise MergerError(f"buffer {missing[0]} is missing from module, {file}")
    return tensors


def _refuse_parallel_dims(model: dict, file: str) -> None:
    dims = model.get("checkpoint_parallel_dimensions") or {}
    tp, pp = dims.get("tp_degree", 1), dims.get("pp_degree", 1)
    if model.get("mp_world_size", 1) != 1 or tp != 1 or pp != 1:
        raise MergerError(f"model-parallel DeepSpeed checkpoint (mp_world_size {model.get('mp_world_size')}, "
                          f"tp {tp}, pp {pp}): merger reads data-parallel ZeRO checkpoints only, {file}")


def open_catalog(root: Path) -> Catalog:
    step = step_dir(root)
    _refuse_model_parallel(step)
    optim_files = _optim_files(step)
    opt = _optimizer_state(load_states(optim_files[0], "optim_states"), optim_files[0])
    stage, world = _stage_and_world(opt, optim_files[0])
    if world != len(optim_files):
        raise MergerError(f"partition_count is {world} but there are {len(optim_files)} optim_states files, "
                          f"{optim_files[0]}")
    part_sizes = _partition_numels(opt, stage, optim_files[0])
    model_files = _model_files(step, stage, world)
    model = load_states(model_files[0], "model_states")
    _refuse_parallel_dims(model, model_files[0])
    shape_groups = _shape_groups(model, model_files[0])
    if stage < 3:
        trainable = _stage12_tensors(shape_groups, opt.get("param_alignment_paddings"), optim_files, part_sizes, step)
    else:
        trainable = _stage3_tensors(shape_groups, optim_files, part_sizes, step)
    tensors = {**_frozen_tensors(model, model_files, stage), **trainable}
    shared = model.get("shared_params") or {}
    tensors.update(_module_tensors(model, model_files[0], stage, set(tensors) | set(shared)))
    for tied, source in shared.items():
        if source in tensors:  # written once when config.json ties them, as save_pretrained does
            tensors[tied] = dataclasses.replace(tensors[source], name=tied)
    return Catalog(format="deepspeed", root=root, tensors=tensors, files=optim_files + model_files,
                   reader_factory=DeepSpeedReader, hf_dir=config_dir(step.parent), check_file=check_zip_end,
                   details={"zero_stage": stage, "dp_world_size": world, "checkpoint": str(step),
                            "ds_version": str(model.get("ds_version")),
                            "param_groups": len(shape_groups), "partition_numels": part_sizes})


class DeepSpeedReader:
    """Reads runs of the flat partitions, frozen fragments and buffers from the files one merge rank opened."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.stage = catalog.details["zero_stage"]
        self.states = MappedStates(self._load)

    @staticmethod
    def _load(file: str) -> dict:
        return load_states(file, "optim_states" if file.endswith("_optim_states.pt") else "model_states")

    def _source(self, copy: PieceCopy) -> tuple[torch.Tensor, bool, int]:
        """The tensor a copy's key names, whether the piece is all of it, and the piece's first element in it."""
        kind, _, rest = copy.key.partition(":")
        name, _, start = rest.rpartition(":")
        state = self.states[copy.file]
        if kind == "fp32":
            groups = _flat_groups(_optimizer_state(state, copy.file), self.stage, copy.file)
            value = groups[int(name)] if int(name) < len(groups) else None
        else:
            value = (state.get("module" if kind == "module" else "frozen_param_fragments") or {}).get(name)
        if not isinstance(value, torch.Tensor):
            raise MergerError(f"{kind} tensor {name} is missing from this file, {copy.file}")
        return value, kind == "module" or (kind == "frozen" and self.stage < 3), int(start)

    def _view(self, copy: PieceCopy, piece: ShardPiece) -> torch.Tensor:
        value, whole, start = self._source(copy)
        if whole:
            if tuple(value.shape) != piece.sizes:
                raise MergerError(f"{copy.key} is {tuple(value.shape)} here but {piece.sizes} in rank 0's "
                                  f"model_states, {copy.file}")
            return value
        if value.dim() != 1 or start + piece.numel > value.numel():
            raise MergerError(f"flat tensor {copy.key.rpartition(':')[0]} holds {value.numel()} elements, fewer "
                              f"than the param shapes place there ({start + piece.numel}), {copy.file}")
        return value.narrow(0, start, piece.numel).view(piece.sizes)

    def check_files(self, files: list[str]) -> None:
        mine = set(files)
        for file in files:
            if file.endswith("_optim_states.pt"):
                sizes = _partition_numels(_optimizer_state(self.states[file], file), self.stage, file)
                if sizes != self.catalog.details["partition_numels"]:
                    raise MergerError(f"this rank's partitions (with their padding) hold {sizes} elements where "
                                      f"rank 0's hold {self.catalog.details['partition_numels']}, {file}")
        for tensor in self.catalog.tensors.values():
            for piece in tensor.pieces:
                for copy in piece.copies:
                    if copy.file in mine and (dtype := self._view(copy, piece).dtype) != tensor.dtype:
                        raise MergerError(f"{copy.key} is {dtype} here but {tensor.dtype} in rank 0's files, "
                                          f"{copy.file}")

    def locate(self, copy: PieceCopy, piece: ShardPiece, dtype: torch.dtype) -> Stored:
        return self.states.stored(copy.file, self._view(copy, piece))
