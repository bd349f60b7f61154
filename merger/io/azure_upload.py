"""Writes into an az:// container, in Azure Blob's protocol: whole blobs by Put Blob (adlfs), the lock by a Put Blob
that only creates (If-None-Match: *, adlfs's create mode), files of several parts as block blobs: each part a block that any process
stages (Put Block), the blob made of them, in order, by one Put Block List.

Azure has no upload to abort: staged blocks belong to the blob's name, not to an upload, and are not a blob until a
block list names them. A killed merge's blocks are never part of a later merge's blob (each upload names its blocks
by its own id), and the service drops uncommitted blocks a week after the last was staged.
"""
from __future__ import annotations

import uuid

from .object_upload import ObjectWriter


class AzureWriter(ObjectWriter):
    async def _on_blob(self, name: str, method: str, *args, **kwargs):
        # a blob client of adlfs's own service client: its retries and timeouts (store_waits.py) hold here too
        async with self.fs.service_client.get_blob_client(container=self.bucket, blob=self.key(name)) as blob:
            return await getattr(blob, method)(*args, **kwargs)

    def begin(self, name: str) -> str:
        return uuid.uuid4().hex  # no request: a block list is made of blocks, not of an upload the store opens

    def _blob_call(self, name: str, method: str, *args):
        from fsspec.asyn import sync  # fsspec is imported only by merges that name a bucket (io/locations.py)

        return self._call(name, sync, self.fs.loop, self._on_blob, name, method, *args)

    def upload_part(self, name: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        block = f"{upload_id}-{number:05d}"  # every block id of a blob has one length, as Azure requires
        self._blob_call(name, "stage_block", block, bytes(data))
        return block

    def complete(self, name: str, upload_id: str, etags: list[str]) -> None:
        self._blob_call(name, "commit_block_list", etags)

    def abort(self, name: str, upload_id: str) -> None:
        """Nothing to send: see the module's note."""

    def open_uploads(self) -> list[tuple[str, str]]:
        return []  # staged blocks are no upload that can be dropped: see the module's note
