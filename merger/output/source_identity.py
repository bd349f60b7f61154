"""Which files a merge read, by identity: taken when the checkpoint is opened, checked again before the finished
folder is moved into place, and kept in the manifest, where `--resume` compares it.

A file's identity is what its storage says changes with any write (merger/io: inode, ctime and mtime for a
local file; ETag and version for an object).
"""
from __future__ import annotations

from ..catalog import Catalog
from ..errors import MergerError, SourceError
from ..io import file_identity, location, relative_name


def source_identity(catalog: Catalog) -> dict[str, dict[str, int]]:
    """Every source file's identity, keyed by its path relative to the checkpoint folder."""
    out = {}
    for f in catalog.files:
        try:
            out[relative_name(f, catalog.root)] = file_identity(f)
        except OSError as e:
            raise SourceError(f"cannot stat the source file ({e.strerror}), {f}") from e
    return out


def source_folder(catalog: Catalog) -> str:
    """The checkpoint folder with every link resolved: two paths to one checkpoint name the same source."""
    return str(location(catalog.root).resolve())


def check_unchanged(catalog: Catalog, before: dict[str, dict[str, int]]) -> None:
    """Raise when any source file is not the one the merge started reading: gone, replaced or written to."""
    changed = []
    for rel, was in before.items():
        path = str(location(catalog.root) / rel)
        try:
            now = file_identity(path)
        except OSError:
            changed.append((path, "it is gone"))
            continue
        fields = [k for k in was if now.get(k) != was[k]]
        if fields:
            changed.append((path, f"its {', '.join(fields)} changed"))
    if changed:
        path, what = changed[0]
        more = f" (and {len(changed) - 1} more source files)" if len(changed) > 1 else ""
        raise MergerError(f"a source file changed while it was being merged ({what}){more}: the output could mix "
                          f"old and new tensors, so nothing was moved to the target; merge again once the "
                          f"checkpoint is final, {path}")
