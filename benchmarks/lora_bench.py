"""Peak memory of folding a LoRA adapter into a multi-GB base: `merger lora` vs PEFT's own route
(from_pretrained, PeftModel.from_pretrained, merge_and_unload, save_pretrained), side by side in one run.

    python benchmarks/lora_bench.py --work /tmp/lora_bench --layers 4 16 [--keep]

For each base size it writes a bf16 Llama-shaped base (random weights, sharded safetensors) and one PEFT
adapter (r=16 on every linear layer), runs both routes as separate processes and reports each one's peak
RSS (the kernel's ru_maxrss of that process) and wall time. Both outputs are checked equal at the end. Each base's
folder (GiBs) is removed once measured, unless --keep (a kept folder's base and adapter are reused next time).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_ROUTE = """
import sys, torch, transformers, peft
base, adapter, out = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
model.save_pretrained(out)
"""


def llama_config(layers: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                    tie_word_embeddings=False, dtype="bfloat16")


def write_base_and_adapter(folder: Path, layers: int) -> tuple[Path, Path]:
    """The base's shapes and names come from transformers (a meta-device model), its values are random; the
    adapter is saved by PEFT from that model with random lora weights."""
    import peft
    import transformers
    from safetensors.torch import save_file

    base, adapter = folder / "base", folder / "adapter"
    if (base / "config.json").is_file() and (adapter / "adapter_config.json").is_file():
        return base, adapter
    config = llama_config(layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    base.mkdir(parents=True, exist_ok=True)
    shards, current, size, weight_map = [], {}, 0, {}
    for name, p in model.state_dict().items():
        current[name] = (torch.randn(p.shape, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        size += current[name].nbytes
        if size > 1_000_000_000:
            shards.append(current)
            current, size = {}, 0
    shards.append(current)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, base / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.nbytes for s in shards for t in s.values())
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config.save_pretrained(base)
    del shards, current

    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    for name, module in wrapped.named_modules():
        if name.endswith(("lora_A.default", "lora_B.default")):  # only these leave the meta device
            module.weight = torch.nn.Parameter(torch.randn(module.weight.shape) * 0.01)
    wrapped.save_pretrained(adapter)
    return base, adapter


# A small launcher process starts each route: a child forked straight from this (large) process would count
# the pages it shares with it before exec in its own peak RSS.
LAUNCHER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if code == 0 else -1)
"""


def measure(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in GiB, seconds) of one route, run as its own process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    kib = int(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else -1
    if proc.returncode != 0 or kib < 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return kib / 2**20, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    p.add_argument("--max-inflight", default="256MiB")
    p.add_argument("--keep", action="store_true", help="keep the bases, adapters and outputs under --work")
    args = p.parse_args()
    from safetensors.torch import load_file

    rows = []
    for layers in args.layers:
        folder = args.work / f"layers{layers}"
        print(f"[{layers} layers] writing the base and the adapter (or reusing them) in {folder} ...", flush=True)
        base, adapter = write_base_and_adapter(folder, layers)
        base_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        for out in ("out_merger", "out_peft"):
            shutil.rmtree(folder / out, ignore_errors=True)
        print(f"[{layers} layers] merger lora ...", flush=True)
        merger = measure([sys.executable, "-m", "merger", "lora", "--base", str(base), "--adapter", str(adapter),
                          "--target_dir", str(folder / "out_merger"), "--max-inflight", args.max_inflight])
        print(f"[{layers} layers] PEFT's route ...", flush=True)
        peft_route = measure([sys.executable, "-c", PEFT_ROUTE, str(base), str(adapter), str(folder / "out_peft")])
        print(f"[{layers} layers] comparing the two outputs ...", flush=True)
        ours = {k: v for f in sorted((folder / "out_merger").glob("*.safetensors")) for k, v in load_file(f).items()}
        theirs = {k: v for f in sorted((folder / "out_peft").glob("*.safetensors")) for k, v in load_file(f).items()}
        same = sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        rows.append((layers, base_bytes / 2**30, *merger, *peft_route, same))
        del ours, theirs
        if not args.keep:
            shutil.rmtree(folder)
    print("| layers | base (GiB) | merger peak RSS (GiB) | merger s | PEFT peak RSS (GiB) | PEFT s | outputs equal |")
    print("|---|---|---|---|---|---|---|")
    for layers, gib, m_rss, m_s, p_rss, p_s, same in rows:
        print(f"| {layers} | {gib:.2f} | {m_rss:.2f} | {m_s:.0f} | {p_rss:.2f} | {p_s:.0f} | {same} |")


if __name__ == "__main__":
    main()
