"""A folder laid out as a model in huggingface_hub's cache, as `snapshot_download` leaves one (there is no network
here): `models--{owner}--{name}/blobs/<sha256>` holding each file's bytes, `snapshots/<commit>/<file>` a relative
link to its blob, and `refs/main` naming the commit. huggingface_hub's own `scan_cache_dir` must then list it with
every file, so the layout is the library's, not our idea of it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo_id: str, folder: Path) -> Path:
    """Put every file of `folder` into the cache `cache` as Hub model `repo_id`; returns the snapshot folder."""
    from huggingface_hub import scan_cache_dir

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    for name in names:
        data = (folder / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(Path("..") / ".." / "blobs" / blob, snapshot / name)
    cached = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert sorted(f.file_name for rev in cached[repo_id].revisions for f in rev.files) == names
    return snapshot


def offline_env(cache: Path) -> dict:
    """The environment of a merge that may only read `cache`."""
    return {"HF_HOME": str(cache.parent / "hf_home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
