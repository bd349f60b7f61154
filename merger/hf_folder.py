"""The HF model folder format, in one place: weight file names and index, which files are weights, the config.

Sources read HF folders (a checkpoint's `huggingface/` config folder, a LoRA base model, safetensors weights),
`verify` / `merger test` compare against one, and the output writes one; all of them ask this module.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import MergerError, SourceError
from .io import is_remote, location
from .io.locations import ObjectPath
from .io.fetched import fetched_folder

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG_DIR = "huggingface"  # where trainers put the HF config beside (or inside) their checkpoint folders
# Weight files of a HF folder are never copied into the output: the merge writes the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (INDEX, "pytorch_model.bin.index.json")


def shard_name(index: int, count: int) -> str:
    """The name save_pretrained gives weight file `index` of `count`."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


def read_index(path: Path) -> dict:
    """A safetensors index file: {"weight_map": {tensor: file}, "metadata": ...}."""
    try:
        index = json.loads(path.read_text())
        index["weight_map"] = dict(index["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"cannot read the safetensors index ({e}), {path}") from e
    if not all(isinstance(name, str) for name in index["weight_map"].values()):
        raise MergerError(f"the safetensors index maps a tensor to something other than a file name, {path}")
    return index


def weight_files(root: Path, index: dict | None = None) -> list[Path]:
    """The folder's weight files: those the index names (`index`, when read already), else model.safetensors,
    else every *.safetensors."""
    if index is None and (root / INDEX).is_file():
        index = read_index(root / INDEX)
    if index is not None:  # names the index gives: each must lie inside the folder
        return [named_file(root, name, root / INDEX) for name in dict.fromkeys(sorted(index["weight_map"].values()))]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def config_dir(*candidates: Path) -> Path | None:
    """The first candidate holding a config.json; else the first `huggingface/` folder among them (the config
    folder a trainer wrote, whose missing config.json is then reported), else None."""
    for candidate in candidates:
        if (candidate / CONFIG).is_file():
            return candidate
    return next((c for c in candidates if c.name == CONFIG_DIR and c.is_dir()), None)


def read_config(folder: Path) -> dict:
    """A model's config.json. It must say what model it is (`model_type` or `architectures`): without either,
    transformers can load neither the config nor the merged model (a `{}` merged to `{"dtype": ...}`)."""
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise SourceError(f"no config.json (pass --hf_model_config_path), {folder}") from e
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"cannot read config.json ({e}), {path}") from e
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise MergerError(f"config.json names no model (no model_type, no architectures): give the model's own "
                          f"config (--hf_model_config_path), {path}")
    return config


def is_inside(path: Path, *roots: Path) -> bool:
    """`path` is one of `roots` or lies below one (paths compared as given: resolve them first)."""
    return any(path == root or root in path.parents for root in roots)


def _real_roots(folder: Path) -> list[Path]:
    """Where the files of `folder` may really lie: inside it, or, for a Hub cache snapshot (whose files are
    links into the repo's blobs/), inside that repo's blobs/."""
    roots = [folder.resolve()]
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    return roots


def named_file(folder: Path, name: object, named_in: Path) -> Path:
    """`folder / name` for a file that the checkpoint's own metadata (`named_in`: an index, DCP's `.metadata`, a
    manifest) names: refused unless it lies inside `folder`, symlinks followed only as `files_to_copy` follows
    them. A name like `../x` or `/x`, or a link out of the folder, would let a checkpoint pull any file of the
    machine into the merge (and into a model meant for upload)."""
    if not isinstance(name, str) or not name:
        raise MergerError(f"{named_in.name} names a file as {name!r}, not a relative path, {named_in}")
    path = folder / name
    if not is_inside(path.resolve(), *_real_roots(folder)):
        raise MergerError(f"{named_in.name} names {name!r}, which lies outside the checkpoint folder "
                          f"{folder}, {named_in}")
    return path


def files_to_copy(folder: Path) -> list[Path]:
    """Config, tokenizer, processor, chat template and remote-code files: regular files inside `folder` only.

    A symlink is followed only when it stays inside the folder (or, for a Hub cache snapshot, inside that
    repo's blobs/): a link pointing elsewhere could copy any file of the machine into a model meant for upload.
    """
    roots = _real_roots(folder)
    files = []
    for src in sorted(folder.iterdir()):
        if is_weight_file(src.name):
            continue
        real = src.resolve()
        if not real.is_file() or not is_inside(real, *roots):
            continue  # folders hold no loadable config; a link out of the folder is never followed
        files.append(src)
    return files


def _not_weights(name: str) -> bool:
    # One function for every call: fetched_folder caches per (folder, predicate), and a new lambda at each call
    # fetched the folder again (twice per merge from a bucket).
    return not is_weight_file(name)


def local_config_folder(folder: Path | ObjectPath) -> Path:
    """A model's folder where transformers can read its config: itself, or for a folder in a bucket, a local copy
    of its config, tokenizer and other small files (its weights are read where they lie)."""
    if is_remote(folder):
        return fetched_folder(folder, _not_weights)
    return folder


def model_config_dir(given: Path | None, found: Path | None, checkpoint: Path) -> Path:
    """The folder config.json and the tokenizer come from: `--hf_model_config_path`, else the one the source
    found beside the checkpoint. Checked now, not at the end: only a regular config.json inside it is copied."""
    folder = given or found
    if folder is None:
        raise SourceError(f"no HF config folder found beside the checkpoint (pass --hf_model_config_path), "
                          f"{checkpoint}")
    folder = local_config_folder(location(folder))
    if not folder.is_dir():
        raise SourceError(f"HF config folder does not exist, {folder}")
    if not any(f.name == CONFIG for f in files_to_copy(folder)):
        raise SourceError(f"no config.json (a regular file inside the folder; pass --hf_model_config_path), "
                          f"{folder}")
    return folder
