"""bf16 -> FP8 (`--quantize fp8-block`) against a plain bf16 merge of the same checkpoint: wall time, peak RSS.

    python benchmarks/fp8_bench.py --work /tmp/fp8_bench [--layers 20] [--hidden 2048] [--nproc 1 2] [--keep]

The source is a bfloat16 HF safetensors folder of a Llama-shaped model (hidden 2048: ~51M parameters a layer
plus 131M of embeddings, so 20 layers ~ 2.3 GB), random values written tensor by tensor, never the whole model.
Each merge runs once per rank count (`python -m merger` or torchrun), with `--summary_json`: its wall time and
the largest resident set of any rank. The folders (GBs) are removed after unless --keep.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
SHARD_BYTES = 1 << 30


def build(folder: Path, layers: int, hidden: int) -> int:
    """A bf16 HF folder of a random Llama, in ~1 GiB shards with an index; returns its bytes of weights."""
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                      num_key_value_heads=hidden // 128, tie_word_embeddings=False,
                                      architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    return write_random_folder(folder, config, shapes)


def write_random_folder(folder: Path, config: transformers.PretrainedConfig, shapes: dict[str, torch.Size]) -> int:
    """A bf16 HF safetensors folder of `config` holding `shapes` (name -> shape) as random values, written shard by
    shard (~1 GiB each, with an index), never the whole model; returns its bytes of weights."""
    folder.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    shard, size, files, weight_map, total = {}, 0, 0, {}, 0

    def flush():
        nonlocal shard, size, files
        name = f"model-{files + 1:05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, files = {}, 0, files + 1

    for name, shape in shapes.items():
        shard[name] = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
        size += shard[name].nbytes
        total += shard[name].nbytes
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def merge(source: Path, target: Path, nproc: int, *extra: str) -> dict:
    summary = target.with_suffix(".json")
    launch = ([sys.executable, "-m", "merger"] if nproc == 1 else
              [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(nproc), "-m", "merger"])
    subprocess.run([*launch, "merge", "--local_dir", str(source), "--target_dir", str(target), "--overwrite",
                    "--summary_json", str(summary), *extra], check=True, cwd=ROOT, capture_output=True)
    result = json.loads(summary.read_text())
    out_bytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    shutil.rmtree(target)
    return {"wall_s": result["wall_time_s"], "peak_rss_gib": max(result["peak_rss_bytes_per_rank"]) / 2 ** 30,
            "out_gib": out_bytes / 2 ** 30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    source = args.work / f"bf16-{args.layers}x{args.hidden}"
    if not source.exists():
        build(source, args.layers, args.hidden)
    size = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2 ** 30
    print("| source (GiB) | ranks | merge | output (GiB) | wall s | peak RSS per rank (GiB) |")
    print("|---|---|---|---|---|---|")
    try:
        for nproc in args.nproc:
            for label, extra in (("bf16", ()), ("fp8-block", ("--quantize", "fp8-block"))):
                r = merge(source, args.work / f"out-{label}-{nproc}", nproc, *extra)
                print(f"| {size:.2f} | {nproc} | {label} | {r['out_gib']:.2f} | {r['wall_s']:.1f} | "
                      f"{r['peak_rss_gib']:.2f} |", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
