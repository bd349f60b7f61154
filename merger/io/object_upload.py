"""Writes into a bucket: what a target asks of every store (ObjectWriter), with the calls that fsspec's clients
answer alike (listings, small reads, whole puts, a create only where nothing is, removal). Each store's writer
(s3_upload.py, gcs_upload.py, azure_upload.py) adds its uploads in parts that any process may send: a file of
several parts exists only once its upload is completed, so a reader never sees a half-written weight file.
object_writers.py picks the store's writer.
"""
from __future__ import annotations

from ..errors import TargetError
from .locations import location, storage_of
from .object_store import _refusal


class ObjectWriter:
    """The writes a merge makes under one bucket prefix. Keys are `bucket/key`, as fsspec names objects."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.scheme = self.url.split("://", 1)[0].lower()
        self.storage, self.prefix = storage_of(str(location(self.url)))
        self.fs = self.storage.fs
        self.bucket, _, self.key_prefix = self.prefix.partition("/")

    def key(self, name: str) -> str:
        return f"{self.key_prefix}/{name}" if self.key_prefix else name

    def url_of(self, name: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key(name)}"

    def _path(self, name: str) -> str:
        return f"{self.bucket}/{self.key(name)}"  # as fsspec names it

    def _call(self, name: str, what, *args, **kwargs):
        try:
            return what(*args, **kwargs)
        except (FileExistsError, FileNotFoundError):  # answers the caller takes: a create refused, an object gone
            raise
        except Exception as e:  # noqa: BLE001 - one line per refusal, never the credentials
            raise _refusal(e, self.url_of(name), "a write") from e

    def check_bucket(self) -> None:
        if self.storage.kind(self.bucket) is None:
            raise TargetError(f"no such bucket, {self.scheme}://{self.bucket}")

    def names(self, under: str = "") -> list[str]:
        """Every object below the prefix (or its folder `under`), by its name relative to the prefix."""
        folder = f"{self.prefix.rstrip('/')}/{under}".rstrip("/")
        try:
            found = self.fs.find(folder, refresh=True)  # afresh: a listing cached before the lock is stale
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001 - one line per refusal, never the credentials
            raise _refusal(e, f"{self.url}/{under}".rstrip("/"), "a listing") from e
        start = len(self.prefix.rstrip("/")) + 1
        return sorted(f[start:] for f in found if f.startswith(folder + "/"))

    def read(self, name: str) -> bytes | None:
        """A small object's bytes, read afresh (the storage's caches are for sources, which do not change); None
        where there is none."""
        try:
            return self.fs.cat_file(f"{self.bucket}/{self.key(name)}")
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise _refusal(e, self.url_of(name)) from e

    def put(self, name: str, data: bytes | bytearray) -> None:
        """Write a whole object, replacing any of that name."""
        # bytes: azure-storage-blob takes a bytearray for a stream and fails on it
        self._call(name, self.fs.pipe_file, self._path(name), bytes(data))

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` only where no object of that name exists (the store's conditional write); False where one
        did."""
        try:
            self._call(name, self.fs.pipe_file, self._path(name), data, mode="create")
        except FileExistsError:
            return False
        return True

    def remove(self, names: list[str]) -> None:
        """Remove these objects; one already gone is no error."""
        for name in names:
            try:
                self._call(name, self.fs.rm_file, self._path(name))
            except FileNotFoundError:
                pass

    # Each store's own:
    def begin(self, name: str) -> str:
        """An upload of `name` in parts: its id, which every rank sending parts of it is given."""
        raise NotImplementedError

    def upload_part(self, name: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        """Part `number` (from 1; each but the last at least 5 MiB) of an upload: what completes it (`complete`)."""
        raise NotImplementedError

    def complete(self, name: str, upload_id: str, etags: list[str]) -> None:
        """Make the object of the parts `upload_part` answered, in order: it appears whole."""
        raise NotImplementedError

    def abort(self, name: str, upload_id: str) -> None:
        """Drop an upload's parts."""
        raise NotImplementedError

    def open_uploads(self) -> list[tuple[str, str]]:
        """(name, upload id) of the uploads begun under the prefix and neither completed nor aborted."""
        raise NotImplementedError
