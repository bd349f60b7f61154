"""Speed and memory of `merger merge` side by side with the usual ways to merge and the copy floor, in one run.

    python benchmarks/run.py [--formats fsdp,dcp,deepspeed,megatron_moe,megatron_qwen35_moe] [--sizes 7,19|16GB]
                             [--repeats 3] [--cap 2GiB] [--hidden 2048] [--settle 5] [--keep]
                             [--chart docs/benchmark.png]
                             [--ranks 1,2] [--torchrun 2] [--cuda] [--no_baselines] [--build_ranks 2] [--cold]

For each format and checkpoint size (fp32 FSDP2 on 2 ranks, built once under bench_out/ on the meta device
by benchmarks/build_checkpoint.py) it times, alternating and repeated, each run right after its data files are
read into the page cache (`warm`): `cp` of the data files (the floor: bytes read and written once, inside the
kernel), the same `cp` followed by a `sync` of the copies (the copy made durable, as merger's output is), `dd`
of them with `conv=fsync` (the floor for a tool that reads the bytes into memory and writes them back durably,
as a merge must to cast or checksum them), the disk alone (`disk write`: as many bytes as the checkpoint's, from
memory, written past the page cache and fsynced: the disk's durable write speed on this run), a Python start-up
importing torch (what every merge pays before its first read: the lines under the table take it off merger's
1-rank wall), the baselines, and merger with each of --ranks ranks (several started by `launcher local`, and
those of --torchrun also by torchrun), and with --cuda on 1 rank with `--device cuda` (skipped, with the reason in
the table, where torch sees no CUDA device).
With --cold, each run starts instead with the data files out of the page cache (`evict`; Python, torch and merger
stay in it), as a checkpoint is that other nodes wrote or that was evicted since: every run then reads them from
the disk, and a `disk read` row (`cat` of the data files) times the disk's reading of them alone.
- fsdp (verl's `model_world_size_W_rank_r.pt`): baseline the naive merge (benchmarks/naive_merge.py).
- dcp (`dcp.save` folder): baselines torch's `dcp_to_torch_save` + `save_file` and accelerate's
  `merge_fsdp_weights` (benchmarks/dcp_baselines.py); both keep fp32, so merger runs with `--dtype keep`.
- deepspeed (ZeRO-3 fp32, 2 ranks, by real DeepSpeed: benchmarks/build_deepspeed_checkpoint.py): baseline
  DeepSpeed's own `zero_to_fp32.py --safe_serialization`; merger runs with `--dtype keep`.
- megatron_moe (a Qwen3-MoE model with GroupedMLP experts, TP2 EP2, Megatron-LM's legacy format, written by
  megatron-core on 2 ranks: benchmarks/build_megatron_moe_checkpoint.py): baseline the naive merge in fp32
  (benchmarks/naive_megatron_merge.py); merger runs with `--dtype keep`.
- megatron_qwen35_moe (a Qwen3.5-MoE model, Gated DeltaNet and gated attention with routed and shared experts,
  TP2 EP2, legacy format, written by megatron-core on 2 ranks: benchmarks/build_megatron_qwen35_checkpoint.py):
  baseline the hand-written naive merge in fp32 (benchmarks/naive_megatron_qwen35_merge.py); merger runs with
  `--dtype keep`.
--sizes takes layer counts or sizes (`16GB`: the fsdp or dcp checkpoint of that many layers nearest the size;
`make bench SIZES=16GB`). Wall and CPU times (user + system, every process of the run) are medians, CPU s/GB per GB
of the checkpoint's data files; peak RSS is the largest resident set of
any single process of the run (i.e. per rank); ratios are against the cp floor, cp + sync, dd, merger on 1 rank
(`x 1 rank`: the scaling) and the format's first baseline; the same figures are drawn into
docs/benchmark.png (benchmarks/chart.py). With --cap, each merge also runs
under a hard cgroup-v1 memory limit to show which ones fit, merger on 1 rank with --verify too. The checkpoints this run builds (GBs) are removed at
the end unless --keep; kept ones are reused by the next run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.chart import draw_chart  # noqa: E402
from merger.units import format_size, parse_size  # noqa: E402

OUT = ROOT / "bench_out"
PY = sys.executable
CGROUP = Path("/sys/fs/cgroup/memory/merger_bench")
FORMATS = ("fsdp", "dcp", "deepspeed", "megatron_moe", "megatron_qwen35_moe")
FLOOR = "cp (floor)"
SYNCED_FLOOR = "cp + sync"
USER_FLOOR = "dd + fsync"
# The disk's durable write speed, measured beside the runs it bounds: bytes from memory (random, so that no layer
# below can compress or skip them) written past the page cache (O_DIRECT, in 8 MiB writes like merger's direct ones:
# output/direct_writes.py) and fsynced. Buffered writes would time this VM's page cache too: filling new pages
# cost more CPU than the disk took time (3.3 CPU s for 4.4 GB here).
DISK = "disk write"
_DISK_WRITE = ("import mmap, os, sys; path, size = sys.argv[1], int(sys.argv[2]); "
               "os.makedirs(os.path.dirname(path), exist_ok=True); block = mmap.mmap(-1, 8 << 20); "
               "block.write(os.urandom(8 << 20)); flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC\n"
               "try: fd = os.open(path, flags | os.O_DIRECT, 0o644)\n"
               "except OSError: fd = os.open(path, flags, 0o644)  # a filesystem without O_DIRECT\n"
               "at = 0\n"  # the last write rounded up to a block, as O_DIRECT needs
               "while at < size: "
               "at += os.pwrite(fd, memoryview(block)[:-(-min(len(block), size - at) // 4096) * 4096], at)\n"
               "os.fsync(fd); os.close(fd)")
# A Python start-up that imports torch, as merger imports it (the cyclic GC off: cli.load_library): every merge pays it
# before it reads a byte, and no tool that casts with torch can overlap it with the disk's work.
STARTUP = "import torch"
# --cold: the checkpoint's bytes read from the disk and thrown away, at one reader per data file as merger's ranks
# read them (2 ranks, one rank file each, read them at once)
DISK_READ = "disk read"
FLOORS = (FLOOR, SYNCED_FLOOR, USER_FLOOR, DISK, DISK_READ, STARTUP)
ONE_RANK = "merger, 1 rank"
VERIFIED = ONE_RANK  # the run that --cap also tries with --verify
CUDA_ROW = "merger, 1 rank, cuda"
# Written last by build_checkpoint.py: its presence means the checkpoint is complete.
DONE = {"fsdp": "fsdp_config.json", "dcp": "huggingface/config.json", "deepspeed": "config.json",
        "megatron_moe": "huggingface/config.json", "megatron_qwen35_moe": "huggingface/config.json"}
BUILDERS = {"fsdp": "build_checkpoint.py", "dcp": "build_checkpoint.py", "deepspeed": "build_deepspeed_checkpoint.py",
            "megatron_moe": "build_megatron_moe_checkpoint.py",
            "megatron_qwen35_moe": "build_megatron_qwen35_checkpoint.py"}
# The baseline of each Megatron format: the naive fp32 merge a user writes for that model
NAIVE_MEGATRON = {"megatron_moe": "naive_megatron_merge.py", "megatron_qwen35_moe": "naive_megatron_qwen35_merge.py"}

# Runs `cmd`, then prints wall seconds, the max RSS (KiB) over every descendant process, the exit code, and the
# CPU seconds (user + system) of every descendant: the work done, which other load on the machine moves less than
# the wall time.
_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print(time.perf_counter() - t, u.ru_maxrss, rc, u.ru_utime + u.ru_stime)")


def warm(files: list[Path]) -> None:
    """Read `files` into the page cache. This VM's kernel runs a DAMON scheme that pages out file pages left
    unread for about 30 s (/sys/kernel/mm/damon/admin: action pageout, min age 6 x 5 s), so a checkpoint read
    by the previous run is not warm for the next one after a long baseline: 45 s after a full read, 45% of the
    4.13 GiB verl files were gone from the cache and reading them took 4.0 s instead of 1.0 s. Every timed run
    reads them again right before it starts, so each finds them cached alike."""
    chunk = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as src:
            while src.readinto(chunk):
                pass


def evict(files: list[Path]) -> None:
    """Drop `files` from the page cache, and nothing else: their pages are clean (the build was synced), so the
    kernel lets them go at once (`posix_fadvise(DONTNEED)`, as `vmtouch -e` does), without root and without
    emptying the cache of other work, as `echo 1 > /proc/sys/vm/drop_caches` would."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(cmd: list[str], cap: int | None = None, settle: float = 0.0,
            sources: list[Path] = (), cold: bool = False) -> tuple[float, int, int, float]:
    os.sync()  # no run starts while the previous one's output is still being written back to disk
    # A VM that hands freed memory back to its host (virtio-balloon free page reporting, about 2 s after it is
    # freed; this machine's does) backs the next pages written for free only until then, and several times
    # slower after: a run that starts right after the previous output was deleted would be timed on cheaper
    # memory than one that starts later. Each waits alike.
    time.sleep(settle)
    (evict if cold else warm)(sources)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    prefix = [PY, "-c", _MEASURE]
    preexec = None
    if cap:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(cap))

        def preexec():  # join the capped cgroup before exec, so every descendant is held by it
            (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    out = subprocess.run(prefix + cmd, env=env, capture_output=True, text=True, preexec_fn=preexec, cwd=ROOT)
    wall, rss_kib, rc, cpu = out.stdout.split()
    return float(wall), int(rss_kib) * 1024, int(rc), float(cpu)


def layers_for(size: str, fmt: str, hidden: int) -> int:
    """A --sizes entry as a layer count: itself, or for a size (`16GB`) the layer count of the fsdp or dcp benchmark
    model (build_checkpoint.bench_config: vocabulary 32000, intermediate 11/4 of hidden, untied embeddings) whose
    fp32 parameters come nearest it."""
    if size.isdigit():
        return int(size)
    if fmt not in ("fsdp", "dcp"):
        raise SystemExit(f"--sizes {size}: sizes are for fsdp and dcp; give {fmt} a layer count")
    per_layer = 4 * hidden * hidden + 3 * hidden * (hidden * 11 // 4) + 2 * hidden  # attention, MLP, two norms
    fixed = 2 * 32000 * hidden + hidden  # embeddings, lm_head, final norm
    return max(1, round((parse_size(size) / 4 - fixed) / per_layer))


def build(fmt: str, layers: int, hidden: int, built: list[Path], ranks: int = 2, files_per_rank: int = 1) -> Path:
    """The checkpoint, written by `ranks` ranks (one rank file each for fsdp, `files_per_rank` for dcp), built unless a
    complete one is there; what is built here is appended to `built`."""
    model = {"megatron_moe": "qwen3moe", "megatron_qwen35_moe": "qwen35moe"}.get(fmt, "llama")
    name = f"{model}_{hidden}h_{layers}l" + (f"_{ranks}r" if ranks != 2 else "") + (
        f"_{files_per_rank}f" if files_per_rank != 1 else "")
    ckpt = OUT / name / {"fsdp": "actor"}.get(fmt, fmt)
    if not (ckpt / DONE[fmt]).exists():
        print(f"building the {layers}-layer {fmt} checkpoint on {ranks} ranks in {ckpt} ...", flush=True)
        built.append(ckpt)
        proc = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                               str(ROOT / "benchmarks" / BUILDERS[fmt]), "--out", str(ckpt),
                               "--layers", str(layers), "--hidden", str(hidden),
                               *(["--format", fmt] if fmt in ("fsdp", "dcp") else []),
                               *(["--files_per_rank", str(files_per_rank)] if files_per_rank != 1 else [])],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"building {ckpt} failed:\n{proc.stderr[-4000:]}")
    return ckpt


def data_files(fmt: str, ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob({"fsdp": "model_world_size_*.pt", "dcp": "*.distcp",
                             "deepspeed": "global_step1/*_states.pt",
                             "megatron_moe": "iter_*/mp_rank_*/model_optim_rng.pt",
                             "megatron_qwen35_moe": "iter_*/mp_rank_*/model_optim_rng.pt"}[fmt]))


def cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here (torch's view, in the interpreter the merges run in), or None."""
    probe = subprocess.run([PY, "-c", "import torch; print(torch.version.cuda, torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "torch could not be imported"
    built_with, available = probe.stdout.split()
    if built_with == "None":
        return "torch is built without CUDA"
    return None if available == "True" else "torch sees no CUDA device"


def merger_runs(merge: list[str], ranks: list[int], torchrun: list[int], cuda: bool) -> dict[str, list[str]]:
    """Row name -> command line of each merger run: 1 rank, N ranks started by `launcher local` (a plain Python
    parent that only starts them), N by torchrun (whose agent imports torch itself before it starts the ranks:
    1.2-1.4 s of CPU on this project's 2-core machine), all over gloo, and 1 rank with `--device cuda` (one rank
    sends nothing: what it adds is CUDA's part of the start-up)."""
    runs = {}
    cuda_row = [PY, "-m", "merger", *merge, "--device", "cuda"]
    merge = [*merge, "--device", "cpu"]  # over gloo, also where CUDA is there (auto would pick NCCL)
    for n in ranks:
        runs[ONE_RANK if n == 1 else f"merger, {n} ranks"] = (
            [PY, "-m", "merger", *merge] if n == 1 else [PY, "-m", "launcher", "local", "--nproc", str(n), "--", *merge])
    for n in torchrun:
        runs[f"merger, {n}, torchrun"] = [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "-m",
                                          "merger", *merge]
    if cuda:
        runs[CUDA_ROW] = cuda_row
    return runs


def commands(fmt: str, ckpt: Path, dst: Path, ranks: list[int] = (1, 2), torchrun: list[int] = (2,),
             cuda: bool = False, with_baselines: bool = True, cold: bool = False) -> dict[str, list[str]]:
    """Row name -> command line; the floors first (with `cold`, the disk's reading too), then the baselines (the
    first is the ratios' reference), then merger's runs (merger_runs)."""
    # relative paths kept under dst (--parents): Megatron's rank files all have the same name
    files = " ".join(str(p.relative_to(ckpt)) for p in data_files(fmt, ckpt))
    merge = ["merge", "--local_dir", str(ckpt), "--target_dir", str(dst), "--overwrite", "--log_level", "WARNING"]
    if fmt == "fsdp":
        baselines = {"naive merge": [PY, str(ROOT / "benchmarks" / "naive_merge.py"), str(ckpt), str(dst)]}
    elif fmt in NAIVE_MEGATRON:
        merge += ["--dtype", "keep"]  # the naive Megatron merges keep fp32: write the same bytes
        baselines = {"naive merge": [PY, str(ROOT / "benchmarks" / NAIVE_MEGATRON[fmt]), str(ckpt), str(dst)]}
    elif fmt == "deepspeed":
        merge += ["--dtype", "keep"]  # zero_to_fp32 writes fp32: write the same bytes
        # DeepSpeed's own script, copied into the checkpoint by save_checkpoint (it imports deepspeed)
        baselines = {"zero_to_fp32": [PY, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(dst), "--safe_serialization"]}
    else:
        merge += ["--dtype", "keep"]  # the DCP baselines write fp32: write the same bytes
        baselines = {name: [PY, str(ROOT / "benchmarks" / "dcp_baselines.py"), name, str(ckpt), str(dst)]
                     for name in ("dcp_to_torch_save", "accelerate")}
    # cp copies inside the kernel (copy_file_range): no byte reaches user space. A tool that casts or checks
    # the bytes must read them into memory and write them back out, fsynced: dd does just that, the floor for it,
    # in 256 KiB writes like merger's (output/files.py WRITE_CHUNK: with bs=1M it took 2.5-3x as long here).
    dd = " && ".join(f"mkdir -p {dst}/{Path(f).parent} && dd if={f} of={dst}/{f} bs=256K conv=fsync status=none"
                     for f in files.split())
    cp = f"mkdir -p {dst} && cd {ckpt} && cp --parents {files} {dst}/"
    # `sync FILE...` fsyncs those files alone (coreutils), as merger fsyncs its own: not other work's dirty pages
    synced = f"{cp} && cd {dst} && sync {files}"
    size = sum(f.stat().st_size for f in data_files(fmt, ckpt))
    read = " & ".join(f"cat {f} > /dev/null" for f in files.split()) + " & wait"
    return {FLOOR: ["bash", "-c", cp], SYNCED_FLOOR: ["bash", "-c", synced], USER_FLOOR: ["bash", "-c", f"cd {ckpt} && {dd}"],
            DISK: [PY, "-c", _DISK_WRITE, str(dst / "disk_write"), str(size)],
            **({DISK_READ: ["bash", "-c", f"cd {ckpt} && {read}"]} if cold else {}),
            STARTUP: [PY, "-c", "import gc; gc.disable(); import torch"],
            **(baselines if with_baselines else {}), **merger_runs(merge, ranks, torchrun, cuda)}


def time_all(cmds: dict[str, list[str]], dst: Path, repeats: int, label: str, settle: float,
             sources: list[Path], cold: bool = False) -> dict[str, list[tuple[float, int, int, float]]]:
    results: dict[str, list[tuple[float, int, int, float]]] = {k: [] for k in cmds}
    for rep in range(repeats + 1):  # the first round is dropped
        for name, cmd in cmds.items():
            shutil.rmtree(dst, ignore_errors=True)
            print(f"{label}: {name}, {f'run {rep} of {repeats}' if rep else 'warm-up'} ...", end=" ", flush=True)
            r = measure(cmd, settle=settle, sources=sources, cold=cold)
            print(f"{r[0]:.1f} s", flush=True)
            if r[2] != 0:
                raise SystemExit(f"{name} failed with exit code {r[2]}: {' '.join(cmd)}")
            if rep:
                results[name].append(r)
    return results


def fits_under(cmds: dict[str, list[str]], dst: Path, cap: int) -> dict[str, str]:
    """Each merge (not the floors) once under the hard memory cap: "fits" or "killed"; merger on 1 rank also with
    --verify, which streams under the same budget, so it must fit where the plain merge fits."""
    verdicts = {}
    for name, cmd in cmds.items():
        if name in FLOORS:
            continue
        runs = {name: cmd, f"{name} --verify": cmd + ["--verify"]} if name == VERIFIED else {name: cmd}
        found = []
        for label, run in runs.items():
            shutil.rmtree(dst, ignore_errors=True)
            print(f"{label} under a {format_size(cap)} cap ...", flush=True)
            found.append(("fits" if measure(run, cap)[2] == 0 else "killed") + label.removeprefix(name))
        verdicts[name] = ", ".join(found)
    return verdicts


# Ratio columns: header -> the row whose median wall time divides each run's (merger's ratios: the targets)
RATIOS = {"x cp": FLOOR, "x cp+sync": SYNCED_FLOOR, "x dd": USER_FLOOR, "x 1 rank": ONE_RANK}


def rows_for(fmt: str, size: int, results: dict, capped: dict[str, str], skipped: dict[str, str]) -> list[tuple]:
    """One table row per run: (format, size, run, wall median, CPU median, {ratio column: value}, peak RSS,
    RSS x baseline, note); a run in `skipped` (name -> why) has no figures, its reason as the note."""
    def median(name: str) -> float | None:
        return statistics.median(r[0] for r in results[name]) if results.get(name) else None

    baseline = next((name for name in results if name not in FLOORS and not name.startswith("merger")), None)
    refs = {col: median(name) for col, name in {**RATIOS, "x base": baseline}.items() if name}
    base_rss = max(r[1] for r in results[baseline]) if baseline else None
    rows = []
    for name, rs in results.items():
        wall, rss = median(name), max(r[1] for r in rs)
        ratios = {col: wall / ref for col, ref in refs.items() if ref and (col != "x 1 rank" or name.startswith("merger"))}
        rows.append((fmt, size, name, wall, statistics.median(r[3] for r in rs), ratios, rss,
                     rss / base_rss if base_rss else None, capped.get(name, "")))
    return rows + [(fmt, size, name, None, None, {}, None, None, f"skipped: {why}") for name, why in skipped.items()]


def print_table(rows: list[tuple], cap: int | None, repeats: int, cold: bool = False) -> None:
    cap_col = f"under {format_size(cap)}" if cap else ""
    cols = [*RATIOS, "x base"]
    width = max([12, *(len(row[0]) for row in rows)])  # the format column fits the longest name

    def cell(value: float | None, width: int, fmt: str = "6.2f") -> str:
        return f"{value:{fmt}}".rjust(width) if value is not None else " " * width

    header = (f"{'format':<{width}} | {'checkpoint':>10} | {'run':<20} | {'wall s':>6} | {'CPU s':>6} | "
              f"{'CPU s/GB':>8} | "
              + " | ".join(f"{c:>9}" for c in cols) + f" | {'peak RSS/rank':>13} | {'x base RSS':>10} | {cap_col}")
    print("\n" + header)
    print("-" * len(header))
    for fmt, size, name, wall, cpu, ratios, rss, vs_rss, note in rows:
        print(f"{fmt:<{width}} | {format_size(size):>10} | {name:<20} | {cell(wall, 6)} | {cell(cpu, 6)} | "
              f"{cell(cpu / (size / 1e9) if cpu is not None else None, 8, '8.3f')} | "
              + " | ".join(cell(ratios.get(c), 9) for c in cols)
              + f" | {format_size(rss) if rss is not None else '':>13} | {cell(vs_rss, 10)} | {note}")
    state = "cold runs (the data files out of the page cache)" if cold else "warm runs"
    print(f"\nmedians of {repeats} {state}; {os.cpu_count()} cores; CPU s = user + system CPU of every process of "
          "the run; CPU s/GB = per GB (1e9 bytes) of the checkpoint's data files; disk write = as many bytes from "
          "memory, written past the page cache and fsynced (the disk's durable write speed); peak RSS = largest "
          "process of the run; "
          "x cp+sync = against cp and a sync of the copies (the copy made durable); x dd = against dd with "
          "conv=fsync (the bytes through memory, durably); x 1 rank = against merger on 1 rank (the scaling); "
          "x base = against the naive merge (fsdp), dcp_to_torch_save + save_file (dcp), DeepSpeed's zero_to_fp32.py "
          "--safe_serialization (deepspeed), the naive fp32 merge (megatron_moe, megatron_qwen35_moe); import torch = "
          "a Python start-up importing torch, which every merge pays before its first read; disk read = the data files read "
          "from the disk (cold runs), one reader per file at once. Targets (issue 34): merger "
          "on 2 ranks <= 1.00 x 1 rank; merger on 1 rank <= 0.75 x cp+sync")
    for line in disk_speeds(rows) + after_startup(rows):
        print(line)


def disk_speeds(rows: list[tuple]) -> list[str]:
    """Per checkpoint, the disk's durable write speed measured in the same run (the `disk write` row), and with
    --cold its reading speed (`disk read`)."""
    done = {DISK: "wrote {} GB/s durably", DISK_READ: "read {} GB/s"}
    return [f"{fmt} {format_size(size)}: the disk {done[name].format(f'{size / wall / 1e9:.2f}')} ({name}: "
            f"{format_size(size)} in {wall:.2f} s)" for fmt, size, name, wall, *_ in rows if name in done and wall]


def after_startup(rows: list[tuple]) -> list[str]:
    """Per checkpoint, merger on 1 rank with the `import torch` row's median taken off, against cp + sync: how the
    merge itself stands against the 1-rank target on a machine whose start-up is a large share of the run."""
    walls = {(fmt, size, name): wall for fmt, size, name, wall, *_ in rows if wall is not None}
    lines = []
    for (fmt, size, name), wall in walls.items():
        startup, synced = walls.get((fmt, size, STARTUP)), walls.get((fmt, size, SYNCED_FLOOR))
        if name == ONE_RANK and startup is not None and synced:
            of = f"import torch: {startup:.2f} s of {wall:.2f} s"
            # a checkpoint too small for the two medians to part: the merge ended within the start-up's spread
            lines.append(f"{fmt} {format_size(size)}: merger on 1 rank after the start-up, {wall - startup:.2f} s = "
                         f"{(wall - startup) / synced:.2f} x cp+sync ({of})" if wall > startup else
                         f"{fmt} {format_size(size)}: merger on 1 rank took no longer than a start-up importing torch "
                         f"({of}): too small to time the merge itself")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="fsdp,dcp", help=f"checkpoint formats to run, of {', '.join(FORMATS)} "
                   "(deepspeed needs the test extra's deepspeed, the megatron ones its megatron-core)")
    p.add_argument("--sizes", default="7,19", help="layer counts of the checkpoints (7 ~ 2 GB, 19 ~ 4.5 GB fp32; "
                   "megatron_moe: 6 ~ 2.6 GB; megatron_qwen35_moe: 4 ~ 2.7 GB, 8 ~ 4.9 GB), or for fsdp and dcp "
                   "sizes (16GB: the layer count nearest it)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the model (smaller for quick checks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds every timed run waits after the previous output is deleted and synced (see measure)")
    p.add_argument("--cap", type=parse_size, default=None, help="also run each merge under this hard memory cap")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints built under bench_out/ for the next run")
    p.add_argument("--chart", type=Path, default=ROOT / "docs" / "benchmark.png",
                   help="where to draw wall time and peak RSS against checkpoint size (PNG)")
    p.add_argument("--ranks", default="1,2", help="merger's rank counts, started by `launcher local` (1: plain)")
    p.add_argument("--torchrun", default="2", help="rank counts also started by torchrun ('' for none)")
    p.add_argument("--cuda", action="store_true", help="also merger on 1 rank with --device cuda (skipped, with the "
                   "reason in the table, where torch sees no CUDA device)")
    p.add_argument("--no_baselines", action="store_true", help="leave out the baselines (floors and merger only)")
    p.add_argument("--cold", action="store_true", help="start every run with the data files out of the page cache "
                   "(read from the disk), not in it")
    p.add_argument("--build_ranks", type=int, default=2,
                   help="ranks that write the fsdp and dcp checkpoints, one rank file each (default 2)")
    args = p.parse_args()
    ranks = [int(n) for n in args.ranks.split(",")]
    torchrun = [int(n) for n in args.torchrun.split(",") if n]
    formats = args.formats.split(",")
    if not set(formats) <= set(FORMATS):
        p.error(f"--formats: choose from {', '.join(FORMATS)}")

    no_cuda = cuda_missing() if args.cuda else None
    if no_cuda:
        print(f"{CUDA_ROW}: skipped ({no_cuda})", flush=True)
    rows, built = [], []
    dst = OUT / "target"
    try:
        for fmt in formats:
            for layers in (layers_for(x, fmt, args.hidden) for x in args.sizes.split(",")):
                ckpt = build(fmt, layers, args.hidden, built, args.build_ranks if fmt in ("fsdp", "dcp") else 2)
                files = data_files(fmt, ckpt)
                size = sum(f.stat().st_size for f in files)
                cmds = commands(fmt, ckpt, dst, ranks, torchrun, args.cuda and no_cuda is None,
                                not args.no_baselines, args.cold)
                results = time_all(cmds, dst, args.repeats, f"{fmt} {format_size(size)}", args.settle,
                                   files, args.cold)
                capped = fits_under(cmds, dst, args.cap) if args.cap else {}
                shutil.rmtree(dst, ignore_errors=True)
                rows += rows_for(fmt, size, results, capped, {CUDA_ROW: no_cuda} if args.cuda and no_cuda else {})
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        for ckpt in [] if args.keep else built:
            print(f"removing {ckpt} (--keep keeps it)", flush=True)
            shutil.rmtree(ckpt, ignore_errors=True)
            if ckpt.parent.is_dir() and not any(ckpt.parent.iterdir()):
                ckpt.parent.rmdir()
        if OUT.is_dir() and not any(OUT.iterdir()):
            OUT.rmdir()
    print_table(rows, args.cap, args.repeats, args.cold)
    draw_chart([(fmt, size, name, wall, rss) for fmt, size, name, wall, _, _, rss, _, _ in rows if wall is not None],
               args.chart, FLOOR)
    print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
