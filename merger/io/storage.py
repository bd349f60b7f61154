"""The protocol every place that holds checkpoint files implements: what `merger/io/locations.py` hands out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    """One name in a folder (a prefix of a bucket): a file or a folder below it."""

    name: str
    is_dir: bool


class Storage(Protocol):
    """A place holding files named by keys (a local path; `bucket/key` in a bucket).

    Every method raises MergerError with one line naming the file for what the place refuses (no such bucket,
    access denied, an endpoint that does not answer), and FileNotFoundError for a key that is not there, which
    the caller names in its own terms ("rank file is missing").
    """

    def identity(self, key: str) -> dict[str, int | str]:
        """What says the file is still the one that was read (size included): compared at the end of a merge and
        by `--resume`. Raises FileNotFoundError when the file is gone."""

    def size(self, key: str) -> int:
        """The file's size in bytes; FileNotFoundError when there is none."""

    def list(self, key: str) -> list[Entry]:
        """The folder's entries, sorted by name; [] for a folder that does not exist."""

    def kind(self, key: str) -> str | None:
        """"file", "dir", or None when nothing is there."""

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes [start, start + length) of the file (to its end when `length` is None); fewer where it ends."""

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes [start, end) of the file for each range, fetched together where the storage can."""

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        """Fill `view` with the file's bytes from `offset`, as far as the file goes; the number of bytes read."""

    def will_read(self, ranges: list[tuple[str, int, int]]) -> None:
        """The (key, start, end) byte ranges the caller reads next, in its order, replacing those said before: a
        storage that fetches ahead (a bucket's) fetches along them; one that does not (local files) ignores them."""

    def local_fd(self, key: str) -> int | None:
        """An open descriptor of a local file (the kernel's copy and mapping paths use it); None elsewhere."""

    def close(self) -> None:
        """Let go of what reading held open (descriptors, cached blocks)."""
