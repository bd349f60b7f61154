"""`--hf_upload_path user/name [--private]`: put a finished merge on the Hugging Face Hub.

Called on rank 0 only, after the rename into place (and after `--verify` when asked), so nothing partial is
ever published. `merger upload --target_dir DIR --hf_upload_path user/name` publishes a folder such a merge
finished, for a retry after a failed upload: only one whose manifest says it is complete. The token comes from
where huggingface_hub always looks (HF_TOKEN, `hf auth login`'s cache); merger never reads, prints or logs it. Big outputs go through `upload_large_folder`, which is
resumable and uploads in parallel; smaller ones are one commit with `upload_folder`.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path

from huggingface_hub import HfApi

from ..errors import MergerError
from ..units import format_size
from .manifest import MANIFEST, read_manifest
from .target_folder import is_staging

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


def upload_command(folder: Path, repo_id: str, private: bool) -> str:
    """The `merger upload` command line that publishes `folder`, as the user can paste it."""
    words = ["merger", "upload", "--target_dir", str(folder), "--hf_upload_path", repo_id]
    return shlex.join(words + (["--private"] if private else []))


def upload_merged(folder: Path, repo_id: str, private: bool) -> str:
    """`merge --hf_upload_path`: upload the model just merged; if that fails, say how to retry without merging."""
    try:
        return upload(folder, repo_id, private)
    except MergerError as e:
        raise MergerError(f"{e}; the merged model is complete there, retry the upload alone with: "
                          f"{upload_command(folder, repo_id, private)}") from e


def _check_finished(folder: Path) -> None:
    """Refuse anything but a folder a merge finished: its manifest exists and says `"complete": true`, every
    output file it lists is there with its size, and it is not a staging folder left by a failed merge."""
    if not folder.is_dir():
        raise MergerError(f"no such folder, {folder}")
    if is_staging(folder):
        raise MergerError(f"this is the staging folder of a merge that did not finish, not a merged model, {folder}")
    path = folder / MANIFEST
    try:
        manifest = read_manifest(folder)
    except FileNotFoundError:
        raise MergerError(f"not a folder merger wrote: it has no {MANIFEST}, {folder}") from None
    except (OSError, ValueError) as e:
        raise MergerError(f"cannot read the merge manifest ({e}), {path}") from e
    if manifest.complete is not True:
        raise MergerError(f'the merge that wrote this folder did not finish ({MANIFEST} lacks "complete": true), '
                          f"{path}")
    for name, entry in (manifest.output_files or {}).items():
        file = folder / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or entry.size is not None and size != entry.size:
            what = "is missing" if size is None else f"has {size} bytes where the manifest says {entry.size}"
            raise MergerError(f"the merged model is damaged: {name} {what}, {file}")


def publish_folder(folder: Path, repo_id: str, private: bool) -> str:
    """`merger upload`: publish a finished merge (see _check_finished); returns the repo's URL."""
    _check_finished(folder)
    return upload(folder, repo_id, private)
