"""Writes into a gs:// bucket, in the JSON API of Google Cloud Storage (gcsfs): whole objects by a media upload,
the lock by an upload that only creates (ifGenerationMatch=0, gcsfs's create mode), files of several parts by
compose: each part an object of its own below PARTS, which any process uploads, composed in order into the file (32
sources a request, so larger files compose in rounds), then removed.

Unlike S3's uploads and Azure's staged blocks, the parts are objects a listing shows. They lie under the target's
`.merger-parts/`, beside the files, never under a file's own name: a reader of the target sees no weight file
before it is whole, and the next merge into the prefix finds a killed merge's parts there and removes them.
"""
from __future__ import annotations

import uuid
from urllib.parse import quote

from .object_upload import ObjectWriter

PARTS = ".merger-parts"  # below the target prefix: PARTS/<upload id>/<file name>/<part number>
COMPOSE_MAX = 32  # sources of one compose request, GCS's limit


class GcsWriter(ObjectWriter):
    def names(self, under: str = "") -> list[str]:
        return [n for n in super().names(under) if not n.startswith(PARTS + "/")]

    def put(self, name: str, data: bytes | bytearray) -> None:
        # A media upload, whose body is the object's bytes. gcsfs's own one-request upload (pipe_file) is
        # multipart/related with a bare LF before its closing delimiter, and a parser that takes CRLF for the
        # delimiter (the GCS emulator's: Python's email parser) drops an object's last byte where it is CR; so parts
        # and weight files never go that way. (`create` does: the lock is JSON, and its condition is sent there.)
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o"
        self._call(name, lambda: self.fs.call("POST", url, uploadType="media", name=self.key(name), data=bytes(data),
                                              headers={"Content-Type": "application/octet-stream"}))

    def begin(self, name: str) -> str:
        return uuid.uuid4().hex  # no request: the parts are objects, composed at the end

    def upload_part(self, name: str, upload_id: str, number: int, data: bytes | memoryview) -> str:
        part = f"{PARTS}/{upload_id}/{name}/{number:05d}"
        self.put(part, data)
        return part

    def complete(self, name: str, upload_id: str, etags: list[str]) -> None:
        sources, round_ = list(etags), 0
        while len(sources) > COMPOSE_MAX:  # compose in rounds: each round's objects are the next one's sources
            groups = [sources[i:i + COMPOSE_MAX] for i in range(0, len(sources), COMPOSE_MAX)]
            sources = [f"{PARTS}/{upload_id}/{name}/r{round_}-{i:05d}" for i in range(len(groups))]
            for group, into in zip(groups, sources):
                self._compose(into, group)
            round_ += 1
        self._compose(name, sources)
        self.abort(name, upload_id)

    def _compose(self, into: str, sources: list[str]) -> None:
        self._call(into, self.fs.merge, self._path(into), [self._path(s) for s in sources])

    def abort(self, name: str, upload_id: str) -> None:
        """Remove the upload's parts (and the rounds composed of them)."""
        folder = f"{PARTS}/{upload_id}/{name}"
        found = ObjectWriter.names(self, folder)  # the parts themselves, which this class's names() leaves out
        if found:
            self._call(folder, self.fs.rm, [self._path(n) for n in found])

    def open_uploads(self) -> list[tuple[str, str]]:
        start = len(PARTS) + 1
        # PARTS/<upload id>/<file name, with its folders>/<part number or round>
        found = {tuple(n[start:].rsplit("/", 1)[0].split("/", 1)) for n in ObjectWriter.names(self, PARTS)}
        return sorted((name, upload_id) for upload_id, name in found)
