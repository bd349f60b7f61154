"""Writes into an s3:// bucket, in S3's protocol (what every S3-compatible store speaks), each call botocore's own
(what the retries in store_waits.py and the fault tests see): whole objects by PutObject, the lock by a conditional
PutObject (If-None-Match), files of several parts by multipart uploads.

An upload that is never completed (a killed merge) stays invisible, stored and billed, until `abort` or the
bucket's lifecycle rule for incomplete uploads removes it.
"""
from __future__ import annotations

from .object_store import _refusal
from .object_upload import ObjectWriter


class S3Writer(ObjectWriter):
    def _s3(self, name: str, method: str, **kwargs):
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as e:  # noqa: BLE001 - one line per refusal, never the credentials
            raise _refusal(e, self.url_of(name), "a write") from e

    def put(self, name: str, data: bytes) -> None:
        self._s3(name, "put_object", Key=self.key(name), Body=data)

    def create(self, name: str, data: bytes) -> bool:
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key(name), Body=data, IfNoneMatch="*")
        except FileExistsError:
            return False
        except Exception as e:  # noqa: BLE001
            raise _refusal(e, self.url_of(name), "a write") from e
        return True

    def remove(self, names: list[str]) -> None:
        for name in names:
            self._s3(name, "delete_object", Key=self.key(name))

    def begin(self, name: str) -> str:
        return self._s3(name, "create_multipart_upload", Key=self.key(name))["UploadId"]

    def upload_part(self, name: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        return self._s3(name, "upload_part", Key=self.key(name), UploadId=upload_id, PartNumber=number,
                          Body=bytes(data))["ETag"]

    def complete(self, name: str, upload_id: str, etags: list[str]) -> None:
        parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
        self._s3(name, "complete_multipart_upload", Key=self.key(name), UploadId=upload_id,
                   MultipartUpload={"Parts": parts})

    def abort(self, name: str, upload_id: str) -> None:
        self._s3(name, "abort_multipart_upload", Key=self.key(name), UploadId=upload_id)

    def open_uploads(self) -> list[tuple[str, str]]:
        found = self._s3("", "list_multipart_uploads", Prefix=self.key(""))
        start = len(self.key(""))
        return [(u["Key"][start:], u["UploadId"]) for u in found.get("Uploads", [])]
