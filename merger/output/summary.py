"""What a merge did, as one plain dict: `merger.merge()` returns it on every rank, and `--summary-json` writes it
as JSON from rank 0, on success and on failure."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..catalog import Catalog
from ..engine.compare import CompareResult
from ..engine.dist import Group
from ..engine.memory import peak_rss_per_rank
from ..engine.plan import Plan, traffic
from ..io import fetched_bytes, is_remote, location
from ..options import MergeOptions
from .safetensors_layout import file_layout


def output_files(plan: Plan) -> list[dict]:
    """Each output file: its name, its bytes on disk (header and data) and its tensors (a summary's and inspect's)."""
    return [{"name": f.name, "bytes": file_layout(f).size, "tensors": len(f.entries)} for f in plan.files]


def merge_summary(catalog: Catalog, plan: Plan, options: MergeOptions, group: Group, started: float,
                  verify: CompareResult | None, uploaded: str | None, error: str | None) -> dict:
    """What was merged, by how many ranks, into what, how fast, how much memory, verified; the same on every rank
    (a sync point: every rank's peak memory is gathered)."""
    peaks = peak_rss_per_rank(group)
    c = catalog
    return {
        "status": "failed" if error else "ok", "error": error,
        "source_format": c.format, "source_dir": str(location(options.local_dir).absolute()),
        "checkpoint_world_size": c.details.get("world_size"), "merge_world_size": group.world,
        "target_dir": str(options.target_dir if is_remote(options.target_dir) else Path(options.target_dir).absolute()), "dtype": options.dtype,
        "tensors": len(plan.location), "bytes": plan.total_bytes,
        "output_files": output_files(plan),
        "wall_time_s": round(time.monotonic() - started, 3), "peak_rss_bytes_per_rank": peaks,
        "bytes_per_rank": traffic(plan),
        # what the ranks GET from a bucket, read-ahead included: about `bytes` of source when each byte is read once
        "fetched_bytes_per_rank": group.all_gather(fetched_bytes()) if is_remote(options.local_dir) else None,
        "verify": verify.as_dict() if verify else None, "uploaded_to": uploaded,
    }


def write_summary(path: Path, summary: dict, group: Group) -> None:
    if group.rank == 0:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
