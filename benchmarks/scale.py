"""How planning scales with a checkpoint's size, from metadata alone: no data is written or read.

    python benchmarks/scale.py [--fractions 1/8,1/4] [--ranks 64] [--experts 256] [--merge_ranks 8,32,64] [--tmp /tmp]
                               [--keep] [--format dcp|torch_dist] [--parallel TP,ETP,EP,PP]

For each fraction of a DeepSeek-V3-shaped model (671B parameters, bf16, 45k tensors at 1x) saved by FSDP2 on
`--ranks` ranks (every tensor cut into one Shard(0) chunk per rank: 2.9 M chunks at 1x, 64 ranks), it writes
a DCP folder whose `.metadata` is pickled from torch's own classes (torch.distributed.checkpoint.metadata,
as FileSystemWriter does) and whose `__r_0.distcp` files are sparse (truncated to their size, nothing on
disk). The fraction scales the MoE layers; 1/8 is a quick run. `--experts 384` gives the 1T shape of Kimi-K2
(the same layers with its 384 experts: 998B parameters, 67,667 tensors, 4.3 M chunks at 1x). `--format torch_dist`
writes the same model as Megatron-LM saves it instead (megatron-core's torch_dist: a save dir with
`iter_0000001/`, its `.metadata` also pickled from torch's classes, with megatron-core's names, chunks per
TP/expert-TP/EP/PP shard and its `all_local_plans`; scale_torch_dist.py) at `--parallel` (default 2,1,64,8: TP2,
expert TP1, EP64, PP8 on 512 ranks, as Megatron-LM's DeepSeek-V3 example trains it; 46 k chunks at 1x). The folder is synthesized in a child process, so that no
measured process inherits its peak RSS. It then times, each in a fresh process:
- torch: the `.metadata` loaded as torch's FileSystemReader loads it (a plain pickle.load with torch's
  classes): the baseline, what any DCP reader pays;
- merger, phase by phase in one process: load_compact (`.metadata` read as open_catalog reads it: the runs of
  chunks and storage entries as arrays, the rest by the restricted unpickler), open_catalog (again, the load
  included), build_mapping, plan_layout (1 rank), the plan rerouted for each --merge_ranks, and the Route
  objects rank 0 makes from the plan's columns while streaming (1 rank, and the largest --merge_ranks);
- `merger inspect --merge_ranks N --json` end to end, for the largest N (its output's sha256 printed: the same
  plan before and after a change has the same).
Each row gives wall seconds, CPU seconds (steadier than wall time on a shared machine) and the process's
peak RSS so far. The folders are removed unless --keep.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import resource
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ITERATION = "iter_0000001"  # where scale_torch_dist.py puts a Megatron-LM save dir's checkpoint

# DeepSeek-V3 (HF config of deepseek-ai/DeepSeek-V3, MTP layer left out): 3 dense layers, then MoE layers.
V3 = dict(hidden=7168, vocab=129280, dense_layers=3, moe_layers=58, experts=256, moe_inter=2048, inter=18432,
          q_lora=1536, kv_lora=512, heads=128, qk_nope=128, qk_rope=64, v_head=128)


def _shapes(moe_layers: int, experts: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF state dict, name -> shape."""
    c = V3 | {"experts": experts}
    h, qk = c["hidden"], c["qk_nope"] + c["qk_rope"]
    out = {"model.embed_tokens.weight": (c["vocab"], h)}
    for i in range(c["dense_layers"] + moe_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_a_proj.weight": (c["q_lora"], h), p + "self_attn.q_a_layernorm.weight": (c["q_lora"],),
                p + "self_attn.q_b_proj.weight": (c["heads"] * qk, c["q_lora"]),
                p + "self_attn.kv_a_proj_with_mqa.weight": (c["kv_lora"] + c["qk_rope"], h),
                p + "self_attn.kv_a_layernorm.weight": (c["kv_lora"],),
                p + "self_attn.kv_b_proj.weight": (c["heads"] * (c["qk_nope"] + c["v_head"]), c["kv_lora"]),
                p + "self_attn.o_proj.weight": (h, c["heads"] * c["v_head"])}
        mlps = [p + "mlp."] if i < c["dense_layers"] else \
            [p + f"mlp.experts.{e}." for e in range(c["experts"])] + [p + "mlp.shared_experts."]
        inter = c["inter"] if i < c["dense_layers"] else c["moe_inter"]
        for m in mlps:
            out |= {m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h), m + "down_proj.weight": (h, inter)}
        if i >= c["dense_layers"]:
            out |= {p + "mlp.gate.weight": (c["experts"], h), p + "mlp.gate.e_score_correction_bias": (c["experts"],)}
    out |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab"], h)}
    return out


def _config(moe_layers: int, experts: int) -> dict:
    c = V3 | {"experts": experts}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
            "hidden_size": c["hidden"], "vocab_size": c["vocab"], "intermediate_size": c["inter"],
            "moe_intermediate_size": c["moe_inter"], "num_hidden_layers": c["dense_layers"] + moe_layers,
            "first_k_dense_replace": c["dense_layers"], "n_routed_experts": c["experts"], "n_shared_experts": 1,
            "num_attention_heads": c["heads"], "num_key_value_heads": c["heads"], "q_lora_rank": c["q_lora"],
            "kv_lora_rank": c["kv_lora"], "qk_nope_head_dim": c["qk_nope"], "qk_rope_head_dim": c["qk_rope"],
            "v_head_dim": c["v_head"], "num_experts_per_tok": 8, "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def synthesize(folder: Path, fraction: Fraction, ranks: int, experts: int) -> dict:
    """A DCP folder of the fraction of DeepSeek-V3 with `experts` per MoE layer, saved by FSDP2 on `ranks` ranks;
    returns its counts."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    moe_layers = max(1, round(V3["moe_layers"] * fraction))
    shapes = _shapes(moe_layers, experts)
    folder.mkdir(parents=True)
    ends = [0] * ranks
    state, storage, planner = {}, {}, {}
    params = 0
    for fqn, shape in shapes.items():
        rows = -(-shape[0] // ranks)  # FSDP2's Shard(0): ceil-sized blocks, empty ones past the end
        chunks = []
        for r in range(ranks):
            start = min(r * rows, shape[0])
            size = torch.Size([min(rows, shape[0] - start), *shape[1:]])
            offsets = torch.Size([start] + [0] * (len(shape) - 1))
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=size))
            length = 2 * size.numel() + 1024  # bf16 bytes and a torch.save blob's frame, as FileSystemWriter's
            storage[MetadataIndex(fqn, offsets, r)] = _StorageInfo(f"__{r}_0.distcp", ends[r], length)
            ends[r] += length
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape), chunks)
        planner[fqn] = (fqn,)
        params += torch.Size(shape).numel()
    with open(folder / ".metadata", "wb") as f:  # as FileSystemWriter.finish writes it
        pickle.dump(Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage), f)
    for r, end in enumerate(ends):
        with open(folder / f"__{r}_0.distcp", "wb") as f:
            f.truncate(end)  # sparse: metadata is all that is real
    (folder / "huggingface").mkdir()
    (folder / "huggingface" / "config.json").write_text(json.dumps(_config(moe_layers, experts), indent=1))
    return {"params": params, "tensors": len(shapes), "chunks": len(storage),
            "metadata_bytes": (folder / ".metadata").stat().st_size}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(rows: list, name: str, fn):
    t, cpu = time.perf_counter(), _cpu()
    value = fn()
    rows.append({"phase": name, "seconds": round(time.perf_counter() - t, 2), "cpu_seconds": round(_cpu() - cpu, 2),
                 "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})  # KiB
    return value


def _metadata_dir(folder: str) -> Path:
    """Where `.metadata` is: the DCP folder, or a Megatron-LM save dir's iteration."""
    return Path(folder) / ITERATION if (Path(folder) / ITERATION).is_dir() else Path(folder)


def torch_phases(folder: str) -> list:
    """What torch's FileSystemReader.read_metadata does: pickle.load with torch's own classes importable."""
    import torch.distributed.checkpoint.metadata  # noqa: F401 - the classes the pickle names
    import torch.distributed.checkpoint.planner  # noqa: F401 - megatron-core's all_local_plans
    rows: list = []
    with open(_metadata_dir(folder) / ".metadata", "rb") as f:
        _timed(rows, "torch: pickle.load(.metadata)", lambda: pickle.load(f))
    return rows


def merger_phases(folder: str, merge_ranks: list[int]) -> list:
    sys.path.insert(0, str(ROOT))
    from merger.engine.plan import plan_layout, rerouted
    from merger.mapping.registry import build_mapping
    from merger.options import MergeOptions
    from merger.sources import dcp, megatron_dist
    from merger.sources.dcp_metadata import load_compact

    rows: list = []
    source = megatron_dist if megatron_dist.detect(Path(folder)) else dcp
    _timed(rows, "merger: load_compact (.metadata)", lambda: load_compact(_metadata_dir(folder)))
    catalog = _timed(rows, "merger: open_catalog (unpickle included)", lambda: source.open_catalog(Path(folder)))
    options = MergeOptions(local_dir=Path(folder), target_dir=None)
    mapping = _timed(rows, "merger: build_mapping", lambda: build_mapping(catalog, options))
    plan = _timed(rows, "merger: plan_layout (1 rank)", lambda: plan_layout(
        mapping.catalog or catalog, mapping.steps, 1, options.max_shard_size, options.max_inflight, tie=mapping.tie))
    routed = {1: plan}
    for n in merge_ranks:
        routed[n] = _timed(rows, f"merger: rerouted, {n} ranks", lambda: rerouted(plan, mapping.catalog or catalog, n))
    for n in (1, max(merge_ranks)):
        _timed(rows, f"merger: routes rank 0 of {n} makes while streaming", lambda: _routes_made(routed[n], 0))
    return rows


def _routes_made(plan, rank: int) -> int:
    """Make the Route objects that `rank` makes while it streams the plan: stream.py asks each batch for the
    routes the rank reads, and for those it receives (the plan holds them as columns: engine/routes.py)."""
    import numpy as np
    return sum(len(b.routes.at(np.flatnonzero(b.routes.reader == rank))) +
               len(b.routes.at(np.flatnonzero((b.routes.writer == rank) & (b.routes.reader != rank))))
               for b in plan.batches)


def _in_process(function: str, *args) -> list:
    out = subprocess.run([PY, __file__, "--phase", function, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


# Runs the command after it in a fresh process; prints its stdout, then wall seconds, CPU seconds and its peak
# RSS (KiB).
_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); s = time.perf_counter() - t; "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "sys.exit(p.stderr) if p.returncode else print(p.stdout, s, u.ru_utime + u.ru_stime, u.ru_maxrss)")


def inspect_end_to_end(folder: Path, ranks: int) -> dict:
    """`merger inspect --merge_ranks N --json` as a user runs it: wall time and the process's peak RSS."""
    out = subprocess.run([PY, "-c", _MEASURE, PY, "-m", "merger", "inspect", "--local_dir", str(folder),
                          "--merge_ranks", str(ranks), "--json"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"inspect failed: {out.stderr.strip()}")
    text, seconds, cpu, kib = out.stdout.rsplit(None, 3)
    json.loads(text)  # a whole answer
    return {"output_sha256": hashlib.sha256(text.encode()).hexdigest(),  # the same before and after a change
            "phase": f"merger inspect --merge_ranks {ranks} (end to end)", "seconds": round(float(seconds), 2),
            "cpu_seconds": round(float(cpu), 2), "peak_rss_gib": round(int(kib) / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fractions", default="1/8", help="comma-separated fractions of the 671B shape, e.g. 1/8,1/4,1/2,1")
    p.add_argument("--ranks", type=int, default=64, help="FSDP2 ranks that saved the checkpoint")
    p.add_argument("--experts", type=int, default=V3["experts"],
                   help="routed experts per MoE layer: 256 is DeepSeek-V3 (671B); 384 is Kimi-K2's count (998B at 1x)")
    p.add_argument("--format", choices=("dcp", "torch_dist"), default="dcp",
                   help="dcp: FSDP2's DCP save; torch_dist: Megatron-LM's (megatron-core's torch_dist, TP/ETP/EP/PP)")
    p.add_argument("--parallel", default="2,1,64,8",
                   help="torch_dist: TP,ETP,EP,PP of the run that saved it (default: Megatron-LM's DeepSeek-V3 "
                        "example, TP2 EP64 PP8, experts without TP)")
    p.add_argument("--merge_ranks", default="8,32,64", help="comma-separated merge worlds to plan for")
    p.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where the sparse checkpoints go")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (reused by the next run)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    tp, etp, ep, pp = (int(n) for n in a.parallel.split(","))
    if a.phase == "synthesize":  # a child, so that no measured process inherits its peak RSS through fork
        folder, fraction = Path(a.args[0]), Fraction(a.args[1])
        if a.format == "dcp":
            print(json.dumps(synthesize(folder, fraction, a.ranks, a.experts)))
            return
        import torch
        from scale_torch_dist import synthesize_torch_dist
        moe_layers = max(1, round(V3["moe_layers"] * fraction))
        print(json.dumps(synthesize_torch_dist(folder, V3 | {"experts": a.experts, "moe_layers": moe_layers},
                                               _config(moe_layers, a.experts), tp=tp, etp=etp, ep=ep, pp=pp,
                                               dtype=torch.bfloat16, fully_parallel=True)))
        return
    if a.phase:  # a child: one measured process
        rows = torch_phases(*a.args) if a.phase == "torch" else merger_phases(a.args[0], [int(n) for n in a.args[1:]])
        print(json.dumps(rows))
        return
    merge_ranks = [int(n) for n in a.merge_ranks.split(",")]
    for text in a.fractions.split(","):
        fraction = Fraction(text)
        saved_by = f"{a.ranks}" if a.format == "dcp" else f"tp{tp}_etp{etp}_ep{ep}_pp{pp}"
        folder = a.tmp / f"merger_scale_{a.format}_{fraction.numerator}_{fraction.denominator}_{saved_by}_{a.experts}"
        try:
            counts_file = folder / "counts.json"
            if not counts_file.is_file():
                shutil.rmtree(folder, ignore_errors=True)
                t = time.perf_counter()
                made = subprocess.run([PY, __file__, "--phase", "synthesize", "--ranks", str(a.ranks), "--experts",
                                       str(a.experts), "--format", a.format, "--parallel", a.parallel, str(folder),
                                       text], check=True, capture_output=True, text=True)
                counts_file.write_text(made.stdout.splitlines()[-1])
                print(f"(synthesized in {time.perf_counter() - t:.0f} s)", file=sys.stderr)
            counts = json.loads(counts_file.read_text())
            rows = _in_process("torch", str(folder)) + _in_process("merger", str(folder), *map(str, merge_ranks))
            rows.append(inspect_end_to_end(folder, max(merge_ranks)))
        finally:
            if not a.keep:
                shutil.rmtree(folder, ignore_errors=True)
        shape = "DeepSeek-V3 671B" if a.experts == V3["experts"] else f"DeepSeek-V3 with {a.experts} experts"
        saver = f"FSDP2, {a.ranks} ranks" if a.format == "dcp" else \
            f"Megatron torch_dist, TP{tp} ETP{etp} EP{ep} PP{pp}: {counts['ranks']} ranks, {counts['files']} files"
        print(f"\n### {text} of {shape}: {counts['params'] / 1e9:.0f}B params, {counts['tensors']} tensors, "
              f"{counts['chunks']} chunks ({saver}), .metadata {counts['metadata_bytes'] / 2**20:.0f} MiB\n")
        print("| phase | wall s | CPU s | peak RSS (GiB) |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['phase']} | {r['seconds']} | {r['cpu_seconds']} | {r['peak_rss_gib']} |")
        print(f"\n`inspect --json` output sha256: {rows[-1]['output_sha256']}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
