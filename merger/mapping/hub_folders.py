"""`--hf_model_config_path`, `--base_model` and `--quantize_like` given as Hugging Face Hub model ids
(`Qwen/Qwen2.5-7B`).

A value is a Hub id only when no local path of that name exists and it looks like one: `name` or `owner/name`
(no leading `/` or `./`, at most one slash), so a mistyped local folder is not sent to the Hub under another
shape. Its snapshot folder comes from huggingface_hub's `snapshot_download`, which honours its cache (HF_HOME,
HF_HUB_CACHE) and HF_HUB_OFFLINE, fetching only what the flag needs: config, tokenizer, processor, chat template
and remote-code files for a config folder and a release to quantize like (whose safetensors headers are read
from the Hub, fp8_release_layout.py), the safetensors weights too for a base model. The folder is then
read like any local one (a snapshot's files are links into its repo's blobs/, which hf_folder allows).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import MergerError
from ..io import is_remote, location
from ..options import MergeOptions

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
CONFIG_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
WEIGHT_FILES = ["*.safetensors"]


def is_hub_id(value: str) -> bool:
    return _HUB_ID.fullmatch(value) is not None and ".." not in value and not Path(value).exists()


def hub_id_of(folder: Path) -> str | None:
    """The model id of a Hub cache snapshot folder (`.../models--owner--name/snapshots/<commit>`), else None."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")


def _snapshot(repo_id: str, flag: str, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise MergerError(f"{flag} names no local folder, and Hub model {repo_id} is not in the Hugging Face "
                              f"cache ({constants.HF_HUB_CACHE}) with HF_HUB_OFFLINE set, {repo_id}") from e
        raise MergerError(f"{flag} names no local folder, and Hub model {repo_id} is neither cached nor reachable "
                          f"(network?), {repo_id}") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise MergerError(f"{flag} names no local folder, and the Hub has no model {repo_id} this token may read "
                          f"(a typo, or a private or gated repo: HF_TOKEN), {repo_id}") from e
    except Exception as e:  # noqa: BLE001 - an incomplete cached snapshot, an HTTP error: one line, not a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        raise MergerError(f"cannot fetch Hub model {repo_id} for {flag} ({type(e).__name__}: {first}), "
                          f"{repo_id}") from e


def _folder(value: str | Path | None, flag: str, patterns: list[str]) -> Path | None:
    if value is None:
        return None
    if is_remote(value):
        return location(value)  # a bucket's folder: read where it is (hf_folder fetches a config folder's files)
    return _snapshot(str(value), flag, patterns) if is_hub_id(str(value)) else Path(value)


def with_hub_folders(options: MergeOptions) -> MergeOptions:
    """`options` with each of the three flags a local folder: as given, or the Hub model's snapshot folder."""
    return dataclasses.replace(
        options,
        hf_model_config_path=_folder(options.hf_model_config_path, "--hf_model_config_path", CONFIG_FILES),
        base_model=_folder(options.base_model, "--base_model", CONFIG_FILES + WEIGHT_FILES),
        quantize_like=_folder(options.quantize_like, "--quantize_like", CONFIG_FILES))
