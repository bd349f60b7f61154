#!/usr/bin/env bash
# The scaling benchmark in one command, for a many-core GPU machine (issue 34): merger on 1, 2, 4 and 8 ranks over
# gloo (started by `launcher local`; 2 also by torchrun) and on 1 rank with --device cuda, beside cp, cp + sync and
# dd + fsync of the same rank files and a Python start-up importing torch, in one table (benchmarks/run.py). The
# fsdp checkpoint (fp32, verl's layout, 4.13 GiB at 19 layers) is written by 8 ranks, so 8 merge ranks each have a
# rank file of their own to read.
# Needs no network: a Python with torch and transformers (PYTHON, else this repo's .venv, else python3); merger
# runs from this checkout. Without a CUDA device the cuda row is skipped, its reason in the table.
# 5.5 minutes on the lent 16-core H200 machine at the defaults before the `import torch` row came (a build, then
# 36 runs of 5-10 s each with their settle and warm-up reads; that row adds 4 of about 3.5 s; more where the disk
# writes under 1 GB/s: SIZES=7 halves it). Where the Python lacks the isal package (merger's dependency, not
# pip-installed here), merger's CRC-32 is zlib's: the machine line says which (docs/benchmarks.md: 1 rank took
# 1.24x as long with zlib's there). A quick check:
#   HIDDEN=256 SIZES=2 REPEATS=1 SETTLE=0 benchmarks/device.sh
# Settings: SIZES (layers, default 19), HIDDEN (2048), REPEATS (3), SETTLE (seconds, 2), RANKS (1,2,4,8),
# BUILD_RANKS (8); the table and the log go to $OUT when it is set (the device tool's folder), else /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "device.sh: $PYTHON cannot import torch, transformers and safetensors: set PYTHON to one that can" >&2
    exit 1
fi
out="${OUT:-/tmp}"
echo "machine: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB memory," \
     "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)" \
     "$("$PYTHON" -c 'import torch; print("torch", torch.__version__)')," \
     "CRC-32 $("$PYTHON" -c 'import merger.sources.crc32 as c; print(c.crc32.__module__)')"
"$PYTHON" benchmarks/run.py --formats fsdp --sizes "${SIZES:-19}" --hidden "${HIDDEN:-2048}" \
    --repeats "${REPEATS:-3}" --settle "${SETTLE:-2}" --ranks "${RANKS:-1,2,4,8}" --torchrun 2 --cuda \
    --no_baselines --build_ranks "${BUILD_RANKS:-8}" --chart "$out/device_scaling.png" 2>&1 | tee "$out/device_bench.log"
