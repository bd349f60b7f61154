"""A local folder as a merge's target (output/local_target.py): checked before anything is written, and how the
finished model gets there.

The source is never written, moved or deleted, so a target that is the checkpoint, holds it or lies inside it
is refused, and `--overwrite` replaces only an empty folder or an earlier merger output (a folder with
`merge_manifest.json`). The output is staged in `.<target>.merger-partial` beside the target and renamed into
place whole at the end; a target that cannot be renamed over (a mount point, a symbolic link) is refused up front.

One exception, for verl's own flow: `merge --local_dir .../actor --target_dir .../actor/huggingface`, a target
that is the checkpoint's HF config folder. There the weight files, the index and the manifest are added beside
the config and tokenizer already there, each moved in by one rename, and nothing else is replaced or deleted.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import TargetError
from ..hf_folder import is_inside, is_weight_file
from .manifest import MANIFEST, Manifest, read_manifest

STAGE_SUFFIX = ".merger-partial"
STAGE_IN_CONFIG_DIR = STAGE_SUFFIX


@dataclass(frozen=True)
class TargetFolder:
    path: Path  # the folder the user named, absolute
    stage: Path  # where the output is written until it is complete
    lock: Path  # held for the whole merge: one merge per target
    beside_config: bool = False  # the source's HF config folder: weights are added there, nothing replaced
    earlier: bool = False  # holds an earlier merger output, which only --overwrite replaces

    def refuse_earlier(self) -> None:
        raise TargetError(f"target folder holds an earlier merge: pass --overwrite to replace it, {self.path}")


def stage_of(target: Path) -> Path:
    """Where a merge into `target` is written until it is complete: `.<target>.merger-partial` beside it."""
    return target.parent / f".{target.name}{STAGE_SUFFIX}"


def lock_of(target: Path) -> Path:
    """The lock file a merge into `target` holds from its first check to the final rename, beside it."""
    return target.parent / f".{target.name}.merger-lock"


def is_staging(folder: Path) -> bool:
    """A folder a merge writes before it is complete: never a merged model, whatever its manifest says."""
    return folder.name == STAGE_IN_CONFIG_DIR or (folder.name.startswith(".") and folder.name.endswith(STAGE_SUFFIX))


def earlier_merge(folder: Path) -> Manifest | None:
    """The manifest of an earlier merger output in `folder`, None when there is none (or none readable)."""
    try:
        return read_manifest(folder)
    except (OSError, ValueError):
        return None


def _added_by(earlier: Manifest | None) -> set[str]:
    """The top-level names an earlier merge added to a config folder (plain names only: the manifest is a file
    anyone could have edited, and it must never point a removal outside the folder)."""
    names = earlier.added_files if earlier else None
    return {n for n in names if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n
            and os.sep not in n} if isinstance(names, list) else set()


def _check_not_in_source(real: Path, target: Path, sources: list[Path], config_dir: Path | None) -> None:
    for source in sources:
        if is_inside(source, real) and source != config_dir:
            raise TargetError(f"target folder {'is' if source == real else 'holds'} the checkpoint being merged "
                              f"({source}); merger never writes into its source: choose another --target_dir, "
                              f"{target}")
        if is_inside(real, source) and real != config_dir:
            raise TargetError(f"target folder lies inside the checkpoint being merged ({source}); merger never "
                              f"writes into its source: choose a --target_dir outside it, {target}")


def resolve_target(target: Path, sources: list[Path], hf_dir: Path | None, data_files: list[str]) -> TargetFolder:
    """Check `target` against the source folders and files; create its parent. Rank 0, before any output.
    An earlier merger output there is left for the caller to judge (`TargetFolder.earlier`)."""
    target = Path(target).absolute()
    if target.is_symlink():
        raise TargetError(f"target is a symbolic link, which the final rename would replace by a folder: give "
                          f"the folder it points to ({os.path.realpath(target)}), {target}")
    real = target.resolve()
    resolved = sorted({Path(s).resolve() for s in sources})
    # The config folder is a target only while it holds none of the files being merged.
    config_dir = Path(hf_dir).resolve() if hf_dir is not None else None
    if config_dir is not None and any(is_inside(Path(f).resolve(), config_dir) for f in data_files):
        config_dir = None
    _check_not_in_source(real, target, resolved, config_dir)
    if real == config_dir:
        return TargetFolder(target, target / STAGE_IN_CONFIG_DIR, target / ".merger-lock", beside_config=True)
    if target.exists() and not target.is_dir():
        raise TargetError(f"target exists and is not a folder, {target}")
    if target.is_dir():
        if os.path.ismount(target):
            raise TargetError(f"target is a mount point, which the final rename cannot replace: choose a folder "
                              f"inside it, {target}")
    earlier = target.is_dir() and any(target.iterdir())
    if earlier and earlier_merge(target) is None:
        raise TargetError(f"target folder is not empty and holds no merger output (no {MANIFEST}): merger "
                          f"replaces only an empty folder or an earlier merge; choose another --target_dir, {target}")
    _check_parent(target.parent)
    return TargetFolder(target, stage_of(target), lock_of(target), earlier=earlier)


def _check_parent(parent: Path) -> None:
    if parent.exists() and not parent.is_dir():
        raise TargetError(f"target's parent is not a folder, {parent}")
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TargetError(f"cannot create the target's parent folder ({e.strerror}), {parent}") from e
    if not os.access(parent, os.W_OK):
        raise TargetError(f"target's parent folder is not writable, {parent}")


def check_config_dir_entries(target: TargetFolder, names: list[str], overwrite: bool) -> None:
    """Beside the source's config: refuse to replace anything but an earlier merge's files (with --overwrite).

    `names` are the top-level entries the merge adds. Weight files already there that an earlier merge did not
    write would make two models in one folder, so they are refused as well.
    """
    earlier = earlier_merge(target.path)
    ours = _added_by(earlier)
    for entry in sorted(target.path.iterdir()):
        if entry.name in (STAGE_IN_CONFIG_DIR, target.lock.name):
            continue
        if entry.name in ours or entry.name == MANIFEST and earlier is not None:
            if not overwrite:
                raise TargetError(f"the config folder already holds the weights of an earlier merge: pass "
                                  f"--overwrite to replace them, {target.path / MANIFEST}")
        elif entry.name in names or is_weight_file(entry.name):
            raise TargetError(f"the config folder already holds {entry.name}, which no merger run wrote; merger adds "
                              f"weights there only beside config and tokenizer files, {entry}")


def place(target: TargetFolder, overwrite: bool) -> None:
    """Rank 0, last: the complete staging folder becomes the target (or joins the config folder)."""
    if target.beside_config:
        _add_to_config_dir(target)
        return
    path, old = target.path, target.path.parent / f".{target.path.name}.merger-old"
    if path.exists():
        if any(path.iterdir()) and (earlier_merge(path) is None or not overwrite):
            raise TargetError(f"target folder became non-empty during the merge, {path}")
        path.rename(old)
    target.stage.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _add_to_config_dir(target: TargetFolder) -> None:
    """Move each staged entry into the config folder (the manifest last: it marks the merge complete) and remove
    what an earlier merge added that this one did not write again."""
    stale = _added_by(earlier_merge(target.path))
    entries = sorted((p for p in target.stage.iterdir() if p.name != MANIFEST), key=lambda p: p.name)
    for src in entries + [target.stage / MANIFEST]:
        dest = target.path / src.name
        if src.is_dir() and dest.is_dir():
            shutil.rmtree(dest)  # an earlier merge's adapter folder, checked before streaming
        os.replace(src, dest)
        stale.discard(src.name)
    for name in stale:
        victim = target.path / name
        shutil.rmtree(victim) if victim.is_dir() else victim.unlink(missing_ok=True)
    target.stage.rmdir()
