"""`--hf_upload_path user/name [--private]`: put a finished merge on the Hugging Face Hub.

Called on rank 0 only, after the rename into place (and after `--verify` when asked), so nothing partial is
ever published. The token comes from where huggingface_hub always looks (HF_TOKEN, `hf auth login`'s
cache); merger never reads, prints or logs it. Big outputs go through `upload_large_folder`, which is
resumable and uploads in parallel; smaller ones are one commit with `upload_folder`.
"""
from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import HfApi

from .errors import MergerError
from .output import MANIFEST
from .units import format_size

log = logging.getLogger("merger")

# Past this size a single commit risks timing out; upload_large_folder resumes and retries per file.
LARGE_FOLDER_BYTES = 20 * 2**30
# The manifest names local paths of the training machine: it stays local.
NOT_PUBLISHED = [MANIFEST]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def upload(folder: Path, repo_id: str, private: bool) -> str:
    """Create the model repo (kept if it exists) and upload `folder` into it; returns the repo's URL."""
    api = HfApi()
    size = _folder_bytes(folder)
    try:
        url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        if size > LARGE_FOLDER_BYTES:
            api.upload_large_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                    ignore_patterns=NOT_PUBLISHED)
        else:
            api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                              ignore_patterns=NOT_PUBLISHED, commit_message="Upload model merged by merger")
    except Exception as e:  # noqa: BLE001 - network, auth and permission errors all become one line
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MergerError(f"upload to the Hugging Face Hub repo {repo_id} failed ({first_line}), {folder}") from e
    log.info("merger: uploaded %s (%s) to %s%s", folder, format_size(size), repo_id, " (private)" if private else "")
    return str(url)
