"""The public ways to turn a DCP folder into safetensors, timed side by side with merger's numbers.

    python benchmarks/dcp_baselines.py --dcp DIR --out WORKDIR [--only dcp_to_torch_save|accelerate]

- dcp_to_torch_save: torch's `dcp_to_torch_save` into one .pt file, then `torch.load` + safetensors
  `save_file` (what users do by hand; the nested `{"model": ...}` of accelerate is unwrapped).
- accelerate: `accelerate.utils.merge_fsdp_weights(dir, out, safe_serialization=True)` (it expects a folder
  holding the model alone, as accelerate writes it: `pytorch_model_fsdp_0/`, optimizer elsewhere).
Both load the whole model into one process. Each runs in a fresh subprocess, which reports its own wall time
and peak RSS (ru_maxrss), so one baseline's memory never counts against another. `run_baselines()` returns
the results as dicts for the main benchmark to print beside merger's.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASELINES = ("dcp_to_torch_save", "accelerate")


def _dcp_to_torch_save(dcp_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out.mkdir(parents=True, exist_ok=True)
    pt = out / "full.pt"
    dcp_to_torch_save(dcp_dir, pt)
    state = torch.load(pt, map_location="cpu", weights_only=True)
    if isinstance(state.get("model"), dict):
        state = state["model"]  # accelerate's {"model": state_dict}
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    pt.unlink()


def _accelerate(dcp_dir: Path, out: Path) -> None:
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(dcp_dir), str(out), safe_serialization=True)


def _run_here(name: str, dcp_dir: Path, out: Path) -> dict:
    started = time.monotonic()
    {"dcp_to_torch_save": _dcp_to_torch_save, "accelerate": _accelerate}[name](dcp_dir, out)
    wall = time.monotonic() - started
    return {"name": name, "wall_s": round(wall, 3),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_baseline(name: str, dcp_dir: Path, workdir: Path) -> dict:
    """One baseline in a fresh process; its output folder is removed afterwards."""
    out = workdir / f"baseline_{name}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, __file__, "--dcp", str(dcp_dir), "--out", str(workdir), "--only", name,
                           "--in-process"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline {name} failed:\n{proc.stderr[-4000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_baselines(dcp_dir: Path, workdir: Path, names=BASELINES) -> list[dict]:
    return [run_baseline(n, Path(dcp_dir), Path(workdir)) for n in names]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dcp", type=Path, required=True, help="DCP folder (.metadata + __*_*.distcp)")
    p.add_argument("--out", type=Path, required=True, help="scratch folder for the baselines' outputs")
    p.add_argument("--only", choices=BASELINES, default=None)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the child side of run_baseline
    args = p.parse_args()
    if args.in_process:
        print(json.dumps(_run_here(args.only, args.dcp, args.out / f"baseline_{args.only}")))
        return
    for result in run_baselines(args.dcp, args.out, [args.only] if args.only else BASELINES):
        print(json.dumps(result))


if __name__ == "__main__":
    main()
