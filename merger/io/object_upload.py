"""Writes into a bucket: whole small objects, multipart uploads whose parts any process may send, a conditional
create for a lock, listing and removal of a prefix. S3's protocol only (what every S3-compatible store speaks);
gs:// and az:// targets are refused with one line.

An object written by a multipart upload does not exist until the upload is completed, so a reader never sees a
half-written weight file; an upload that is never completed (a killed merge) stays invisible, and is removed by
`abort` or by the bucket's lifecycle rule for incomplete uploads.
"""
from __future__ import annotations

from ..errors import MergerError, TargetError
from .locations import location, storage_of
from .object_store import _refusal


class ObjectWriter:
    """The writes a merge makes under one s3:// prefix. Keys are `bucket/key`, as fsspec names objects."""

    def __init__(self, url: str):
        if not url.lower().startswith("s3://"):
            raise MergerError(f"merged models are written to s3:// buckets only (gs:// and az:// are read, not "
                              f"written), {url}")
        self.url = url.rstrip("/")
        self.storage, self.prefix = storage_of(str(location(self.url)))
        self.fs = self.storage.fs
        self.bucket, _, self.key_prefix = self.prefix.partition("/")

    def key(self, name: str) -> str:
        return f"{self.key_prefix}/{name}" if self.key_prefix else name

    def _call(self, name: str, method: str, **kwargs):
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as e:  # noqa: BLE001 - one line per refusal, never the credentials
            raise _refusal(e, f"s3://{self.bucket}/{self.key(name)}", "a write") from e

    def check_bucket(self) -> None:
        if self.storage.kind(self.bucket) is None:
            raise TargetError(f"no such bucket, s3://{self.bucket}")

    def names(self) -> list[str]:
        """Every object below the prefix, by its name relative to it."""
        try:
            found = self.fs.find(self.prefix, refresh=True)  # afresh: a listing cached before the lock is stale
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise _refusal(e, self.url, "a listing") from e
        start = len(self.prefix.rstrip("/")) + 1
        return sorted(f[start:] for f in found if f.startswith(self.prefix.rstrip("/") + "/"))

    def read(self, name: str) -> bytes | None:
        """A small object's bytes, read afresh (the storage's caches are for sources, which do not change); None
        where there is none."""
        try:
            return self.fs.cat_file(f"{self.bucket}/{self.key(name)}")
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise _refusal(e, f"s3://{self.bucket}/{self.key(name)}") from e

    def put(self, name: str, data: bytes) -> None:
        self._call(name, "put_object", Key=self.key(name), Body=data)

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` only where no object of that name exists (If-None-Match); False where one did."""
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key(name), Body=data, IfNoneMatch="*")
        except FileExistsError:
            return False
        except Exception as e:  # noqa: BLE001
            raise _refusal(e, f"s3://{self.bucket}/{self.key(name)}", "a write") from e
        return True

    def remove(self, names: list[str]) -> None:
        for name in names:
            self._call(name, "delete_object", Key=self.key(name))

    def begin(self, name: str) -> str:
        """A multipart upload of `name`: its id, which every rank uploading parts of it is given."""
        return self._call(name, "create_multipart_upload", Key=self.key(name))["UploadId"]

    def upload_part(self, name: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        """Part `number` (from 1; each but the last at least 5 MiB) of an upload: its ETag, which completes it."""
        return self._call(name, "upload_part", Key=self.key(name), UploadId=upload_id, PartNumber=number,
                          Body=bytes(data))["ETag"]

    def complete(self, name: str, upload_id: str, etags: list[str]) -> None:
        parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
        self._call(name, "complete_multipart_upload", Key=self.key(name), UploadId=upload_id,
                   MultipartUpload={"Parts": parts})

    def abort(self, name: str, upload_id: str) -> None:
        self._call(name, "abort_multipart_upload", Key=self.key(name), UploadId=upload_id)

    def open_uploads(self) -> list[tuple[str, str]]:
        """(name, upload id) of the multipart uploads begun under the prefix and neither completed nor aborted."""
        found = self._call("", "list_multipart_uploads", Prefix=self.key(""))
        start = len(self.key(""))
        return [(u["Key"][start:], u["UploadId"]) for u in found.get("Uploads", [])]
