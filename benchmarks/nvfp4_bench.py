"""bf16 -> NVFP4 and back for a ~2.4 GB Qwen3-MoE: merger against llmcompressor's `model_free_ptq` and
compressed-tensors' own dequantizer, which also stream (one safetensors shard at a time), and the cp floor.

    python benchmarks/nvfp4_bench.py --work /tmp/nvfp4_bench [--llmcompressor DIR] [--layers 11] [--experts 16]
                                     [--repeats 3] [--settle 2] [--keep]

The source is a bfloat16 HF safetensors folder in the layout of Qwen3-30B-A3B's release (hidden 2048, 32 heads of
128, 4 KV heads, experts 768 wide, each expert's gate/up/down its own tensor, as save_pretrained writes them) with
16 experts a layer, 11 layers and a 32000 vocabulary: 2.34 GB of random values in ~1 GiB shards, written shard by
shard (fp8_bench.write_random_folder), never held whole. Timed, alternating, medians of --repeats after a
warm-up round (run.time_all: each run after the previous output is deleted and synced, its sources read into the
page cache first; wall, CPU s of every process, the largest resident set of any one process):
- to NVFP4 (weights only, llmcompressor's `NVFP4A16`): `cp` of the bf16 shards (the floor), llmcompressor's
  `model_free_ptq(BASE, OUT, scheme="NVFP4A16", ignore=[embeddings, lm_head, routers], device="cpu")` and
  `merger merge --backend hf --quantize nvfp4`;
- back to bfloat16, from each tool's NVFP4 output: `cp` of its shards, compressed-tensors'
  `convert_checkpoint(OUT, ..., CompressedTensorsDequantizer(OUT, dtype=torch.bfloat16), max_workers=1,
  device="cpu")` and `merger merge --dtype bfloat16`.
Every run has OMP_NUM_THREADS=1 (run.measure), the tools' defaults otherwise. The two NVFP4 outputs are then
compared tensor by tensor: they differ where the tools share the global scale differently (merger as
llmcompressor's oneshot: each routed expert's gate/up too; model_free_ptq: q/k/v only).

llmcompressor (0.14.0.1, `pip install --no-deps --target DIR llmcompressor==0.14.0.1`, kept out of the project's
venv) is put on the path of its own runs only, from --llmcompressor DIR; where it cannot be imported its rows are
skipped, with the reason. The folders (GBs) are removed at the end unless --keep.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.fp8_bench import write_random_folder  # noqa: E402
from benchmarks.run import FLOOR, PY, rows_for, time_all  # noqa: E402
from merger.units import format_size  # noqa: E402

# What merger's --quantize nvfp4 leaves unquantized, in model_free_ptq's terms (it quantizes every 2-dim `.weight`
# not ignored, norms aside): the embeddings, lm_head and the routers
IGNORE = ["model.embed_tokens", "lm_head", "re:.*mlp.gate$"]
MODEL_FREE_PTQ = ("import sys; sys.path[:0] = [p for p in sys.argv[1:2] if p]; "
                  "from llmcompressor import model_free_ptq; "
                  f"model_free_ptq(sys.argv[2], sys.argv[3], scheme='NVFP4A16', ignore={IGNORE!r}, device='cpu')")
CT_DEQUANTIZE = ("import sys, torch; from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, "
                 "convert_checkpoint; convert_checkpoint(sys.argv[1], sys.argv[2], "
                 "CompressedTensorsDequantizer(sys.argv[1], dtype=torch.bfloat16), max_workers=1, device='cpu')")
LLMC = "llmcompressor model_free_ptq"
MERGER_Q = "merger --quantize nvfp4"
CT = "compressed-tensors dequantizer"


def qwen3_moe(layers: int, experts: int) -> tuple[transformers.PretrainedConfig, dict[str, torch.Size]]:
    """Qwen3-30B-A3B's shapes with fewer layers, experts and vocabulary, and its tensors' names and shapes as its
    release stores them: transformers holds a layer's experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj)
    and its save_pretrained writes them one tensor per expert and projection, as Qwen's release has them."""
    config = transformers.Qwen3MoeConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=layers,
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                         moe_intermediate_size=768, num_experts=experts, num_experts_per_tok=8,
                                         tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        state = transformers.Qwen3MoeForCausalLM(config).state_dict()
    shapes = {}
    for name, t in state.items():
        prefix = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    shapes[f"{prefix}.{e}.{proj}.weight"] = torch.Size([t.shape[1] // 2, t.shape[2]])
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                shapes[f"{prefix}.{e}.down_proj.weight"] = t.shape[1:]
        else:
            shapes[name] = t.shape
    return config, shapes


def llmcompressor_missing(path: str) -> str | None:
    """Why llmcompressor cannot run here (imported as its runs import it), or None; its version is printed."""
    probe = subprocess.run([PY, "-c", "import sys; sys.path[:0] = [p for p in sys.argv[1:2] if p]; "
                            "import llmcompressor; print(llmcompressor.__version__)", path],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"llmcompressor is not importable ({probe.stderr.strip().splitlines()[-1]}); give --llmcompressor DIR"
    print(f"llmcompressor {probe.stdout.strip()}", flush=True)
    return None


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def cp(src: Path, dst: Path) -> list[str]:
    """The floor: the shards copied inside the kernel (copy_file_range), nothing fsynced."""
    return ["bash", "-c", f"mkdir -p {dst} && cp {' '.join(map(str, shards(src)))} {dst}/"]


def merger(source: Path, dst: Path, *flags: str) -> list[str]:
    return [PY, "-m", "merger", "merge", "--local_dir", str(source), "--target_dir", str(dst), "--overwrite",
            "--log_level", "WARNING", *flags]


def quantizers(base: Path, out: Path, llmc_path: str, no_llmc: str | None) -> dict[str, list[str]]:
    """The two ways to NVFP4, writing `out`: llmcompressor's (unless it is missing) and merger's."""
    llmc = {} if no_llmc else {LLMC: [PY, "-c", MODEL_FREE_PTQ, llmc_path, str(base), str(out)]}
    return {**llmc, MERGER_Q: merger(base, out, "--backend", "hf", "--quantize", "nvfp4")}


def compare(a: Path, b: Path) -> tuple[Counter, Counter]:
    """(byte-identical, different) tensors of two folders of the same names, counted by kind (the name with each
    layer's and expert's index as `*`), read one tensor at a time."""
    def where(folder: Path) -> dict[str, Path]:
        out = {}
        for f in shards(folder):
            with safe_open(str(f), "pt") as s:
                out.update(dict.fromkeys(s.keys(), f))
        return out

    in_a, in_b = where(a), where(b)
    if set(in_a) != set(in_b):
        raise SystemExit(f"{a} and {b} hold other tensors: {sorted(set(in_a) ^ set(in_b))[:5]} ...")
    same, other = Counter(), Counter()
    for name in sorted(in_a):
        with safe_open(str(in_a[name]), "pt") as sa, safe_open(str(in_b[name]), "pt") as sb:
            x, y = sa.get_tensor(name), sb.get_tensor(name)
        kind = ".".join("*" if part.isdigit() else part for part in name.split("."))
        equal = x.dtype == y.dtype and x.shape == y.shape and x.view(-1).view(torch.uint8).equal(y.view(-1).view(torch.uint8))
        (same if equal else other)[kind] += 1
    return same, other


def table(rows: list[tuple]) -> list[str]:
    lines = ["| step | run | wall s | CPU s | peak RSS | x cp | x baseline |", "|---|---|---|---|---|---|---|"]
    for step, size, name, wall, cpu, ratios, rss, _, note in rows:
        if wall is None:
            lines.append(f"| {step} | {name} | | | | | {note} |")
            continue
        base = ratios.get("x base")
        lines.append(f"| {step} | {name} | {wall:.1f} | {cpu:.1f} | {format_size(rss)} | {ratios['x cp']:.2f} | "
                     f"{'' if base is None else f'{base:.2f}'} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--llmcompressor", default="", help="a folder holding llmcompressor (pip install --no-deps "
                   "--target DIR llmcompressor==0.14.0.1), put on the path of its runs only")
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settle", type=float, default=2.0, help="seconds each run waits after the previous output is "
                   "deleted (run.measure)")
    p.add_argument("--keep", action="store_true", help="keep the folders under --work")
    args = p.parse_args()
    no_llmc = llmcompressor_missing(args.llmcompressor)
    base, dst = args.work / f"bf16-qwen3moe-{args.layers}l-{args.experts}e", args.work / "target"
    nvfp4 = {LLMC: args.work / "nvfp4-model_free_ptq", MERGER_Q: args.work / "nvfp4-merger"}
    loads = [os.getloadavg()]
    try:
        if not base.exists():
            print(f"building {base} ...", flush=True)
            write_random_folder(base, *qwen3_moe(args.layers, args.experts))
        size = sum(f.stat().st_size for f in shards(base))
        print(f"source: {format_size(size)} in {len(shards(base))} shards", flush=True)
        results = time_all({FLOOR: cp(base, dst), **quantizers(base, dst, args.llmcompressor, no_llmc)}, dst,
                           args.repeats, "to NVFP4", args.settle, shards(base))
        rows = rows_for(f"bf16 {format_size(size)} -> NVFP4", size, results, {}, {LLMC: no_llmc} if no_llmc else {})
        loads.append(os.getloadavg())
        for tool, folder in nvfp4.items():  # each tool's NVFP4 once more, kept: the sources of the way back
            cmd = quantizers(base, folder, args.llmcompressor, no_llmc).get(tool)
            if cmd and not folder.exists():
                subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                               capture_output=True)
        for tool, folder in nvfp4.items():
            if not folder.exists():
                rows.append((f"{tool}'s NVFP4 -> bf16", 0, "(all)", None, None, {}, None, None, f"skipped: {no_llmc}"))
                continue
            nbytes = sum(f.stat().st_size for f in shards(folder))
            back = {FLOOR: cp(folder, dst), CT: [PY, "-c", CT_DEQUANTIZE, str(folder), str(dst)],
                    "merger merge --dtype bfloat16": merger(folder, dst, "--dtype", "bfloat16")}
            step = f"{tool}'s NVFP4 {format_size(nbytes)} -> bf16"
            rows += rows_for(step, nbytes, time_all(back, dst, args.repeats, step, args.settle, shards(folder)), {}, {})
            loads.append(os.getloadavg())
        print("\n".join(["", *table(rows), "", f"medians of {args.repeats}; {os.cpu_count()} cores; CPU s = user + "
                         "system of every process of the run; peak RSS = the largest process; x baseline = against "
                         f"{LLMC} (to NVFP4), {CT} (back); load average (1, 5, 15 min) at the start and after "
                         f"each step: {'; '.join(', '.join(f'{x:.1f}' for x in load) for load in loads)}"]))
        if all(folder.exists() for folder in nvfp4.values()):
            same, other = compare(*nvfp4.values())
            print(f"\nmerger's NVFP4 against model_free_ptq's: {sum(same.values())} tensors byte-identical, "
                  f"{sum(other.values())} not")
            for kind in sorted(set(same) | set(other)):
                print(f"  {kind}: {same[kind]} identical, {other[kind]} other")
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
