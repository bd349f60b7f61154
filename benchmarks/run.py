"""Speed and memory of `merger merge` side by side with the naive in-memory merge and the copy floor, in one run.

    python benchmarks/run.py [--sizes 7,19] [--repeats 3] [--cap 2GiB]

For each checkpoint size (fp32 FSDP2, 2 rank files, built once under bench_out/ on the meta device) it
times, with warm page cache, alternating and repeated: `cp` of the rank files (the floor: bytes read and
written once), the naive merge (benchmarks/naive_merge.py), and merger with 1 and 2 ranks. Wall times are
medians; peak RSS is the largest resident set of any single process of the run (i.e. per rank). With
--cap, each merge also runs under a hard cgroup-v1 memory limit to show which ones fit.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from merger.units import format_size, parse_size  # noqa: E402

OUT = ROOT / "bench_out"
PY = sys.executable
CGROUP = Path("/sys/fs/cgroup/memory/merger_bench")

# Runs `cmd`, then prints wall seconds, the max RSS (KiB) over every descendant process, and the exit code.
_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)")


def measure(cmd: list[str], cap: int | None = None) -> tuple[float, int, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    prefix = [PY, "-c", _MEASURE]
    preexec = None
    if cap:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(cap))

        def preexec():  # join the capped cgroup before exec, so every descendant is held by it
            (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    out = subprocess.run(prefix + cmd, env=env, capture_output=True, text=True, preexec_fn=preexec, cwd=ROOT)
    wall, rss_kib, rc = out.stdout.split()
    return float(wall), int(rss_kib) * 1024, int(rc)


def build(layers: int) -> Path:
    ckpt = OUT / f"llama_{layers}l" / "actor"
    if not (ckpt / "fsdp_config.json").exists():
        print(f"building the {layers}-layer checkpoint ...", flush=True)
        subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(ROOT / "benchmarks" / "build_checkpoint.py"), "--out", str(ckpt), "--layers", str(layers)],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    return ckpt


def commands(ckpt: Path, dst: Path) -> dict[str, list[str]]:
    files = [str(p) for p in sorted(ckpt.glob("model_world_size_*.pt"))]
    merge = ["-m", "merger", "merge", "--local_dir", str(ckpt), "--target_dir", str(dst), "--overwrite",
             "--log_level", "WARNING"]
    return {
        "cp (floor)": ["bash", "-c", f"mkdir -p {dst} && cp {' '.join(files)} {dst}/"],
        "naive merge": [PY, str(ROOT / "benchmarks" / "naive_merge.py"), str(ckpt), str(dst)],
        "merger, 1 rank": [PY, *merge],
        "merger, 2 ranks": [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", *merge],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="7,19", help="layer counts of the checkpoints (7 ~ 2 GB, 19 ~ 4.5 GB fp32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", type=parse_size, default=None, help="also run each merge under this hard memory cap")
    args = p.parse_args()

    rows = []
    for layers in (int(x) for x in args.sizes.split(",")):
        ckpt = build(layers)
        size = sum(f.stat().st_size for f in ckpt.glob("*.pt"))
        dst = OUT / "target"
        cmds = commands(ckpt, dst)
        results: dict[str, list[tuple[float, int, int]]] = {k: [] for k in cmds}
        for rep in range(args.repeats + 1):  # the first round warms the page cache and is dropped
            for name, cmd in cmds.items():
                shutil.rmtree(dst, ignore_errors=True)
                r = measure(cmd)
                if r[2] != 0:
                    raise SystemExit(f"{name} failed with exit code {r[2]}: {' '.join(cmd)}")
                if rep:
                    results[name].append(r)
        capped = {}
        if args.cap:
            for name in ("naive merge", "merger, 1 rank", "merger, 2 ranks"):
                shutil.rmtree(dst, ignore_errors=True)
                capped[name] = "fits" if measure(cmds[name], args.cap)[2] == 0 else "killed"
        shutil.rmtree(dst, ignore_errors=True)
        floor = statistics.median(r[0] for r in results["cp (floor)"])
        naive = statistics.median(r[0] for r in results["naive merge"])
        naive_rss = max(r[1] for r in results["naive merge"])
        for name, rs in results.items():
            wall = statistics.median(r[0] for r in rs)
            rss = max(r[1] for r in rs)
            rows.append((format_size(size), name, wall, wall / floor, wall / naive, rss, rss / naive_rss,
                         capped.get(name, "")))

    cap_col = f"under {format_size(args.cap)}" if args.cap else ""
    print(f"\n{'checkpoint':>11} | {'run':<16} | {'wall s':>6} | {'x cp':>5} | {'x naive':>7} | "
          f"{'peak RSS/rank':>13} | {'x naive RSS':>11} | {cap_col}")
    print("-" * (100 if args.cap else 88))
    for size, name, wall, vs_cp, vs_naive, rss, vs_rss, cap in rows:
        print(f"{size:>11} | {name:<16} | {wall:6.2f} | {vs_cp:5.2f} | {vs_naive:7.2f} | {format_size(rss):>13} | "
              f"{vs_rss:11.2f} | {cap}")
    print(f"\nmedians of {args.repeats} warm runs; {os.cpu_count()} cores; peak RSS = largest process of the run")


if __name__ == "__main__":
    main()
