"""Merging a checkpoint that lies in a bucket: read where it lies, against downloading it first.

    python benchmarks/object_storage.py [--format dcp] [--layers 7] [--hidden 2048] [--writer_ranks 2]
                                        [--files_per_rank 1] [--repeats 3] [--keep] [--endpoint URL --bucket NAME]

The checkpoint (fp32 FSDP2 on 2 ranks, built by benchmarks/build_checkpoint.py as benchmarks/run.py builds it;
7 layers at hidden 2048 is 2.1 GB) is uploaded to a real S3-protocol server on the loopback (moto's, a process of
its own), or with --endpoint to another S3-protocol service (MinIO, Ceph, AWS itself; credentials from the standard
AWS environment) into --bucket, and each run, alternating and repeated, merges it to bf16:
- `download` (the floor for reading it): s3fs's `get` of the whole folder, the library merger reads through;
- `download + merge`: that download, then merger on the local copy: what a user without bucket reads does;
- merger reading the bucket into a local folder, 1 rank, and 2 ranks under torchrun;
- `download + merge + upload`: the same, then s3fs's `put` of the merged folder into the bucket;
- merger from the bucket into the bucket (`--target_dir s3://`), 1 rank, and 2 ranks under torchrun;
- merger on a local copy (no bucket at all), for scale.
Each row's ratio is to its baseline: `download + merge` for a local target, `download + merge + upload` for a
target in the bucket.
Wall time and the largest resident set of any process of the run are medians; `GET / source` is the bytes the
merge's ranks fetched (its summary's fetched_bytes_per_rank) over the checkpoint's data bytes; `peak local disk`
the most disk the run's local folders (download, merged folder, --stage_dir) took at once, their allocated blocks
sampled every 20 ms.

moto answers a ranged GET by reading the whole object and slicing it (moto/s3/responses.py, _handle_range_header),
so against moto a ranged read of a 1 GB object costs a 1 GB read: its wall times say more about moto than about
reading in ranges once the objects are large, so a large checkpoint is best written in many files (`--writer_ranks 16
--files_per_rank 4`: 64 data files of 1/64 each). The bytes fetched do not depend on the server.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.run import OUT, PY, build, data_files, measure  # noqa: E402
from merger.units import format_size  # noqa: E402
from tests.helpers.files import peak_allocated  # noqa: E402
from tests.helpers.object_store import upload_folder  # noqa: E402
from tests.helpers.processes import free_port  # noqa: E402

ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_ALLOW_HTTP": "true"}


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("moto's S3 server did not start (pip install 'moto[server]')")
        time.sleep(0.2)
    return server, f"http://127.0.0.1:{port}"


def upload(folder: Path, bucket: str, prefix: str) -> str:
    import boto3

    return upload_folder(boto3.client("s3"), folder, bucket, prefix)


def download_then_merge(url: str, scratch: str, target: str) -> None:
    """The baseline as one command: the whole folder fetched with s3fs, then merged from the local copy."""
    download(url, scratch)
    subprocess.run([PY, "-m", "merger", "merge", "--local_dir", scratch, "--target_dir", target], check=True)


def download_merge_upload(url: str, scratch: str, target: str, out_url: str) -> None:
    """The baseline of a merge from a bucket into a bucket: download, merge, then s3fs's put of the folder."""
    import s3fs

    download_then_merge(url, scratch, target)
    fs = s3fs.S3FileSystem()
    if fs.exists(out_url):
        fs.rm(out_url, recursive=True)
    fs.put(target + "/", out_url.removeprefix("s3://") + "/", recursive=True)


def download(url: str, scratch: str) -> None:
    import s3fs

    s3fs.S3FileSystem().get(url.removeprefix("s3://") + "/", scratch + "/", recursive=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=("dcp", "fsdp"), default="dcp")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--writer_ranks", type=int, default=2,
                   help="ranks that write the checkpoint, one data file each: against moto, many smaller files keep "
                        "each ranged GET cheap (see above)")
    p.add_argument("--files_per_rank", type=int, default=1, help="dcp: data files each writer rank writes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint built under bench_out/")
    p.add_argument("--endpoint", default=None, help="an S3-protocol service to use instead of starting moto's")
    p.add_argument("--bucket", default="bench", help="the bucket the checkpoint is uploaded to (created if missing)")
    p.add_argument("--max_inflight", default=None,
                   help="merger's --max_inflight for every merge (a batch's bytes: what an s3:// target's stage holds "
                        "at most beside the parts in flight)")
    args = p.parse_args()

    built: list[Path] = []
    ckpt = build(args.format, args.layers, args.hidden, built, args.writer_ranks, args.files_per_rank)
    source_bytes = sum(f.stat().st_size for f in data_files(args.format, ckpt))
    server = None
    if args.endpoint is None:
        server, endpoint = start_server()
        os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    else:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    work = Path(tempfile.mkdtemp(prefix="merger-bench-s3-", dir=OUT))
    try:
        url = upload(ckpt, args.bucket, f"merger-bench/{ckpt.parent.name}")
        target, scratch, summary = str(work / "out"), str(work / "scratch"), work / "summary.json"
        flags = ["--max_inflight", args.max_inflight] if args.max_inflight else []
        merge = ["-m", "merger", "merge", "--target_dir", target, "--summary_json", str(summary), *flags]
        out_url = f"s3://{args.bucket}/merger-bench-out/{ckpt.parent.name}"
        stage = str(work / "stage")  # under `work`, where the local disk a run takes is sampled
        into_bucket = ["-m", "merger", "merge", "--target_dir", out_url, "--overwrite", "--summary_json", str(summary),
                       "--stage_dir", stage, *flags]
        torchrun = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                    "--master_port", str(free_port())]
        runs = {
            "download (s3fs get)": [PY, __file__, "--_download", url, scratch],
            "download + merge": [PY, __file__, "--_download_then_merge", url, scratch, target],
            "merger from S3, 1 rank": [PY, *merge, "--local_dir", url],
            "merger from S3, 2 ranks (torchrun)": [*torchrun, *merge, "--local_dir", url],
            "download + merge + upload": [PY, __file__, "--_download_merge_upload", url, scratch, target, out_url],
            "merger S3 -> S3, 1 rank": [PY, *into_bucket, "--local_dir", url],
            "merger S3 -> S3, 2 ranks (torchrun)": [*torchrun, *into_bucket, "--local_dir", url],
            "merger, local folder": [PY, *merge, "--local_dir", str(ckpt)],
        }
        results: dict[str, list[tuple[float, int, float | None, int]]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, cmd in runs.items():
                for leftover in (target, scratch, stage):
                    shutil.rmtree(leftover, ignore_errors=True)
                summary.unlink(missing_ok=True)
                with peak_allocated(work) as disk:
                    wall, rss, rc, _ = measure(cmd, settle=2)
                if rc != 0:
                    raise SystemExit(f"{name} failed (exit {rc}): {' '.join(cmd)}")
                fetched = None
                if summary.exists():
                    per_rank = json.loads(summary.read_text())["fetched_bytes_per_rank"]
                    fetched = sum(per_rank) / source_bytes if per_rank is not None else None
                results[name].append((wall, rss, fetched, disk[0]))
        bases = {name: statistics.median(w for w, *_ in results[name])
                 for name in ("download + merge", "download + merge + upload")}
        print(f"\n{args.format} checkpoint, {format_size(source_bytes)} of data, fp32 -> bf16, medians of "
              f"{args.repeats}, served by {args.endpoint or 'moto on the loopback'}\n")
        print("| run | wall | x its baseline | peak RSS per process | GET / source | peak local disk |\n"
              "|---|---|---|---|---|---|")
        for name, rows in results.items():
            base = bases["download + merge + upload" if "S3 -> S3" in name or "upload" in name else
                         "download + merge"]
            wall = statistics.median(w for w, *_ in rows)
            rss = statistics.median(r for _, r, *_ in rows)
            got = [f for _, _, f, _ in rows if f is not None]
            disk = statistics.median(d for *_, d in rows)
            print(f"| {name} | {wall:.2f} s | {wall / base:.2f}x | {format_size(rss)} | "
                  f"{f'{statistics.median(got):.3f}' if got else '-'} | {format_size(disk)} |")
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(work, ignore_errors=True)
        for ckpt in [] if args.keep else built:
            shutil.rmtree(ckpt, ignore_errors=True)
            if ckpt.parent.is_dir() and not any(ckpt.parent.iterdir()):
                ckpt.parent.rmdir()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_download":
        download(*sys.argv[2:4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--_download_then_merge":
        download_then_merge(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "--_download_merge_upload":
        download_merge_upload(*sys.argv[2:6])
    else:
        main()
