"""A Megatron torch_dist checkpoint of a DeepSeek-V3-shaped GPTModel (MLA, MoE), from metadata alone.

What megatron-core's dist_checkpointing.save writes with the torch_dist backend, as the test writer
tests/writers/megatron_deepseek.py shows it (megatron-core's local spec): a Megatron-LM save dir with
`latest_checkpointed_iteration.txt`, `huggingface/config.json` beside `iter_0000001/`, which holds `metadata.json`
(sharded_backend torch_dist), `common.pt` and a DCP folder (`.metadata` pickled from torch's own classes,
`__<rank>_<thread>.distcp` files, sparse here). The layout it mirrors:
- one key per layer (`decoder.layers.<l>.…`, the global layer): a DeepSeek-V3 with dense first layers is not
  homogeneous, so Megatron-LM saves it without the stacked layer axis;
- MLA's linears split over TP (linear_proj by columns, the rest by rows), norms whole;
- a dense or shared-expert linear_fc1 as two chunks per TP rank (its gate rows and its up rows, MetadataIndex
  index 0 and 1), linear_fc2 by columns;
- routed experts as `mlp.experts.experts.linear_fc{1,2}.weight` with the expert axis first: one chunk per expert
  and expert-TP rank (fc1's gate and up rows apart again), each expert's `_extra_state/shard_<e>_<E>`;
- an `_extra_state/shard_0_1` beside every other linear; embedding and output layer split by rows over TP.
Each chunk is written by one of the ranks that hold it (ranks numbered tp-cp-ep-dp-pp, as megatron-core's
default order): its first data-parallel replica, or with `fully_parallel` (Megatron-LM's
--ckpt-fully-parallel-save, its default) the least loaded of them, largest chunks first. A rank writes two files
(megatron-core's thread_count 2), split as torch's FileSystemWriter splits them: bytes round robin, then tensors,
largest first, into the lighter file. Metadata's tensors and chunks come in the order of the ranks' plans.
"""
from __future__ import annotations

import json
import math
import pickle
import uuid
from pathlib import Path

TENSOR_FRAME, BYTES_LENGTH = 1577, 1261  # a torch.save blob's bytes beyond the tensor's, a TE _extra_state's blob


def _vocab_padded(vocab: int, tp: int) -> int:
    """Megatron-LM's --make-vocab-size-divisible-by 128, times TP."""
    step = 128 * tp
    return -(-vocab // step) * step


class _Layout:
    """The model's sharded tensors in state-dict order, each chunk with the ranks that hold it."""

    def __init__(self, c: dict, tp: int, etp: int, ep: int, pp: int):
        self.c, self.tp, self.etp, self.ep, self.pp = c, tp, etp, ep, pp
        self.dp = math.lcm(tp, ep * etp) // tp  # the fewest data-parallel replicas the expert layout needs
        self.edp = tp * self.dp // (ep * etp)
        self.world = tp * self.dp * pp
        self.items = []  # (fqn, shape or None for bytes, offsets, sizes, index, holders)
        self.layers = c["dense_layers"] + c["moe_layers"]

    def dense_ranks(self, t: int | None, stage: int) -> list[int]:
        """The ranks holding TP shard t (None: every TP rank) of stage `stage`, first replica first."""
        ts = range(self.tp) if t is None else [t]
        return [t_ + self.tp * (d + self.dp * stage) for d in range(self.dp) for t_ in ts]

    def expert_ranks(self, et: int | None, e_rank: int, stage: int) -> list[int]:
        """The ranks holding expert-TP shard et (None: every one) of EP rank e_rank's experts, first replica first."""
        ets = range(self.etp) if et is None else [et]
        return [x + self.etp * (e_rank + self.ep * (d + self.edp * stage)) for d in range(self.edp) for x in ets]

    def add(self, fqn, shape, offsets, sizes, holders, index=None):
        self.items.append((fqn, shape, tuple(offsets), tuple(sizes), index, holders))

    def whole(self, fqn: str, shape: tuple, stage: int) -> None:
        self.add(fqn, shape, [0] * len(shape), shape, self.dense_ranks(None, stage))

    def split(self, fqn: str, shape: tuple, dim: int, stage: int, extra: bool = True) -> None:
        """Split over TP along `dim`, then its linear's extra state."""
        part = shape[dim] // self.tp
        for t in range(self.tp):
            offsets = [0] * len(shape)
            offsets[dim] = t * part
            sizes = list(shape)
            sizes[dim] = part
            self.add(fqn, shape, offsets, sizes, self.dense_ranks(t, stage))
        if extra:
            self.extra(fqn, stage)

    def extra(self, fqn: str, stage: int) -> None:
        self.add(fqn.rsplit(".", 1)[0] + "._extra_state/shard_0_1", None, (), (), self.dense_ranks(None, stage))

    def gated(self, fqn: str, inter: int, stage: int) -> None:
        """fc1 = cat(gate, up): TP rank t holds rows t of each half, two chunks (index 0 and 1)."""
        h, part = self.c["hidden"], inter // self.tp
        shape = (2 * inter, h)
        for t in range(self.tp):
            for k in range(2):
                self.add(fqn, shape, (k * inter + t * part, 0), (part, h), self.dense_ranks(t, stage), k)
        self.extra(fqn, stage)

    def experts(self, prefix: str, stage: int) -> None:
        """Routed experts, expert axis first: EP rank r holds experts r*E/EP.., each cut over expert-TP, in
        SequentialMLP's order (expert by expert: fc1, its extra state, fc2, its extra state)."""
        c, E = self.c, self.c["experts"]
        h, inter, local = c["hidden"], c["moe_inter"], E // self.ep
        part = inter // self.etp
        for r in range(self.ep):
            for e in range(r * local, (r + 1) * local):
                for name, shape in (("linear_fc1", (E, 2 * inter, h)), ("linear_fc2", (E, h, inter))):
                    for et in range(self.etp):
                        holders = self.expert_ranks(et, r, stage)
                        if name == "linear_fc1":  # gate rows, then up rows
                            for k in range(2):
                                self.add(f"{prefix}{name}.weight", shape, (e, k * inter + et * part, 0),
                                         (1, part, h), holders)
                        else:
                            self.add(f"{prefix}{name}.weight", shape, (e, 0, et * part), (1, h, part), holders)
                    self.add(f"{prefix}{name}._extra_state/shard_{e}_{E}", None, (), (),
                             self.expert_ranks(None, r, stage))

    def build(self) -> None:
        c = self.c
        h, heads, last = c["hidden"], c["heads"], self.pp - 1
        vocab = _vocab_padded(c["vocab"], self.tp)
        self.split("embedding.word_embeddings.weight", (vocab, h), 0, 0, extra=False)
        for layer in range(self.layers):
            s, p = layer * self.pp // self.layers, f"decoder.layers.{layer}."
            a = p + "self_attention."
            self.whole(p + "input_layernorm.weight", (h,), s)
            self.split(a + "linear_proj.weight", (h, heads * c["v_head"]), 1, s)
            self.split(a + "linear_q_down_proj.weight", (c["q_lora"], h), 0, s)
            self.split(a + "linear_q_up_proj.weight", (heads * (c["qk_nope"] + c["qk_rope"]), c["q_lora"]), 0, s)
            self.split(a + "linear_kv_down_proj.weight", (c["kv_lora"] + c["qk_rope"], h), 0, s)
            self.split(a + "linear_kv_up_proj.weight", (heads * (c["qk_nope"] + c["v_head"]), c["kv_lora"]), 0, s)
            self.whole(a + "q_layernorm.weight", (c["q_lora"],), s)
            self.whole(a + "kv_layernorm.weight", (c["kv_lora"],), s)
            self.whole(p + "pre_mlp_layernorm.weight", (h,), s)
            if layer < c["dense_layers"]:
                self.gated(p + "mlp.linear_fc1.weight", c["inter"], s)
                self.split(p + "mlp.linear_fc2.weight", (h, c["inter"]), 1, s)
                continue
            self.whole(p + "mlp.router.weight", (c["experts"], h), s)
            self.whole(p + "mlp.router.expert_bias", (c["experts"],), s)
            self.experts(p + "mlp.experts.experts.", s)
            self.gated(p + "mlp.shared_experts.linear_fc1.weight", c["moe_inter"], s)
            self.split(p + "mlp.shared_experts.linear_fc2.weight", (h, c["moe_inter"]), 1, s)
        self.whole("decoder.final_layernorm.weight", (h,), last)
        self.split("output_layer.weight", (vocab, h), 0, last, extra=False)


def _writers(items: list, itemsize: int, fully_parallel: bool) -> list[int]:
    """The rank that writes each item: its first holder, or the least loaded one, the largest items first."""
    if not fully_parallel:
        return [holders[0] for *_, holders in items]
    size = [BYTES_LENGTH if shape is None else math.prod(sizes) * itemsize for _, shape, _, sizes, _, _ in items]
    load: dict[int, int] = {}
    writer = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -size[i]):
        writer[i] = min(items[i][5], key=lambda r: (load.get(r, 0), r))
        load[writer[i]] = load.get(writer[i], 0) + size[i]
    return writer


def synthesize_torch_dist(save_dir: Path, c: dict, hf_config: dict, *, tp: int, etp: int, ep: int, pp: int,
                          dtype, fully_parallel: bool) -> dict:
    """Write the save dir for model dims `c` (scale.V3's keys) saved at TP/ETP/EP/PP; returns its counts."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    layout = _Layout(c, tp, etp, ep, pp)
    layout.build()
    items, itemsize = layout.items, dtype.itemsize
    writer = _writers(items, itemsize, fully_parallel)
    by_rank: list[list[int]] = [[] for _ in range(layout.world)]
    for i, r in enumerate(writer):
        by_rank[r].append(i)
    # The objects shared as megatron-core's pickle shares them: a chunk of the metadata is its plan item's; the
    # plan items' keys and the storage entries' keys are their own (each rank's plan and write results are
    # gathered as pickles), their names one string per rank and role.
    state, storage, files, plans, keys = {}, {}, {}, [], {}
    for rank, mine in enumerate(by_rank):
        plan, names = [], {}  # what megatron-core keeps of each rank's plan in `.metadata` (all_local_plans)
        for i in mine:  # the global plan: the ranks' plans in rank order
            fqn, shape, offsets, sizes, index, _ = items[i]
            if fqn not in names:
                names[fqn] = ("".join(fqn), "".join(fqn))  # new str objects (for the plan, for the storage)
            offset = None if shape is None else torch.Size(offsets)
            keys[i] = MetadataIndex(names[fqn][1], offset, index)
            if shape is None:
                state.setdefault(fqn, BytesStorageMetadata())
                plan.append(WriteItem(MetadataIndex(names[fqn][0]), WriteItemType.BYTE_IO))
                continue
            chunk, properties = ChunkStorageMetadata(offset, torch.Size(sizes)), TensorProperties(dtype=dtype)
            state.setdefault(fqn, TensorStorageMetadata(properties, torch.Size(shape), [])).chunks.append(chunk)
            plan.append(WriteItem(MetadataIndex(names[fqn][0], offset, index), WriteItemType.SHARD,
                                  tensor_data=TensorWriteData(chunk, properties, torch.Size(shape))))
        plans.append(SavePlan(plan, storage_data=None, planner_data={}, usable=True))
        buckets, loads = [[], []], [0, 0]  # torch's _split_by_size_and_type over 2 threads
        blobs = [i for i in mine if items[i][1] is None]
        for k, i in enumerate(blobs):
            buckets[k % 2].append((i, BYTES_LENGTH))
        for i in sorted((i for i in mine if items[i][1] is not None), key=lambda i: -math.prod(items[i][3])):
            nbytes = math.prod(items[i][3]) * itemsize
            k = loads.index(min(loads))
            buckets[k].append((i, nbytes + TENSOR_FRAME))
            loads[k] += nbytes
        for thread, bucket in enumerate(buckets):
            name, end = f"__{rank}_{thread}.distcp", 0
            for i, length in bucket:
                storage[keys[i]] = _StorageInfo(name, end, length)
                end += length
            files[name] = end
    ckpt = save_dir / "iter_0000001"
    ckpt.mkdir(parents=True)
    (save_dir / "latest_checkpointed_iteration.txt").write_text("1")
    (save_dir / "huggingface").mkdir()
    (save_dir / "huggingface" / "config.json").write_text(json.dumps(hf_config, indent=1))
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    torch.save({}, ckpt / "common.pt")  # what the test writer's megatron-core saves there for a model alone
    meta = Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=str(ckpt), save_id=str(uuid.uuid4())), version="1.0.0")
    meta.all_local_plans = plans  # megatron-core's state_dict_saver adds them (to check a cached plan's reuse)
    with open(ckpt / ".metadata", "wb") as f:  # as FileSystemWriter.finish writes it
        pickle.dump(meta, f)
    for name, end in files.items():
        with open(ckpt / name, "wb") as f:
            f.truncate(end)  # sparse: metadata is all that is real
    tensors = [m for m in state.values() if isinstance(m, TensorStorageMetadata)]
    return {"params": sum(m.size.numel() for m in tensors), "tensors": len(tensors),
            "chunks": sum(len(m.chunks) for m in tensors), "files": len(files), "ranks": layout.world,
            "metadata_bytes": (ckpt / ".metadata").stat().st_size}
