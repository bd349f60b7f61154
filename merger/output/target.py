"""Where a merge's output goes: the write side's one protocol, beside the read side's Storage (io/storage.py).

A target takes a merge through its steps, each a collective that every rank takes, in this order:

    open()      check the target and take its lock (rank 0), before anything is written; False: --resume found
                this merge finished there, nothing to do
    prepare()   the files an interrupted merge finished taken over (checked), the plan's other files created
    write(r)    the plan streamed into them from the checked reader `r`, each block checksummed as it lands
    finish()    index, config, tokenizer and the manifest saying the merge is complete
    commit()    the complete model made the target's, whole: nothing there reads as a model before this
    fail(e)     after any failure: what was made discarded (or kept for --resume), the lock released; may raise a
                clearer error instead of `e` (Interrupted)
    release()   last, whichever way it ended

Between finish() and commit(), `written` is a local folder holding the finished files (what --verify reads);
`where` names the target for the user; `cleanup` is what the peer watch runs when a rank is lost.

Two implementations: a local folder (local_target.py: a staging folder renamed into place) and a bucket prefix
(object_store_target.py: merged through a local target while every rank sends the weight files' parts).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..engine.dist import Group
from ..engine.peer_watch import Cleanup
from ..engine.prepared import Prepared
from ..io import is_remote
from ..options import MergeOptions
from .local_target import LocalTarget
from .object_store_target import ObjectStoreTarget


class Target(Protocol):
    cleanup: Cleanup | None

    @property
    def where(self) -> str: ...

    @property
    def written(self) -> Path: ...

    def open(self) -> bool: ...

    def prepare(self) -> None: ...

    def write(self, reader) -> None: ...

    def finish(self) -> None: ...

    def commit(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def release(self) -> None: ...


def target_of(options: MergeOptions, group: Group, prepared: Prepared) -> Target:
    """The target options.target_dir names: a bucket prefix by its scheme, else a local folder."""
    if is_remote(options.target_dir):
        return ObjectStoreTarget(options, group, prepared)
    return LocalTarget(options, group, prepared)
