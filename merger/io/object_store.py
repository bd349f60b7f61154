"""Objects in a bucket (s3://, and gs:// or az:// where gcsfs or adlfs is installed), through fsspec.

Credentials, region and endpoint come from the client library's standard environment and files
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/config...): merger takes none of its own and prints none.

A merge rank reads each piece front to back, a megabyte at a time. One GET per megabyte would spend the merge
on request latency, so reads are served from blocks of BLOCK bytes. A read that goes on from where the file's
last one was (a piece longer than a block, or the next piece in the file) fetches READ_AHEAD blocks, their
requests in flight together; one that jumps elsewhere (the next tensor in output order lies elsewhere in the
file) fetches its own block only, so read-ahead is not wasted at every jump. Each byte of the source is then
fetched about once.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ..errors import MergerError
from .storage import Entry

BLOCK = 8 << 20
READ_AHEAD = 4  # blocks fetched together on a miss: 32 MiB in flight
KEEP = 2 * READ_AHEAD  # blocks kept: those just read and those fetched ahead
SMALL = 64 << 10  # reads up to this size that find no large block cached are served from blocks of this size
KEEP_SMALL = 64


# The client libraries log at INFO where they found the credentials and the endpoint: not merger's progress.
for _name in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def _filesystem(scheme: str, url: str):
    try:
        import fsspec
        # a client of its own, made with the environment as it is now (fsspec would reuse an older one)
        return fsspec.filesystem(scheme, skip_instance_cache=True)
    except ImportError as e:
        package = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}.get(scheme, "adlfs")
        raise MergerError(f"reading {scheme}:// needs the {package} package (pip install 'merger[s3]' for "
                          f"s3://), {url}") from e
    except ValueError as e:
        raise MergerError(f"unknown storage {scheme}:// (s3://, gs:// and az:// are known), {url}") from e


def _refusal(e: Exception, url: str, doing: str = "a read") -> Exception:
    """What the store's error means, as one line naming `url`; FileNotFoundError passes through for the caller.
    Never the credentials: the known cases are said in merger's words; any other shows the error's class and the
    first line of the store's message, which names the request, not the keys that signed it."""
    if isinstance(e, (FileNotFoundError, MergerError)):
        return e
    name = type(e).__name__
    text = str(e)
    if isinstance(e, PermissionError) or any(code in text for code in ("AccessDenied", "InvalidAccessKeyId",
                                                                      "SignatureDoesNotMatch", "Forbidden")):
        return MergerError(f"access denied by the object store (check the credentials: AWS_ACCESS_KEY_ID, "
                           f"AWS_PROFILE...), {url}")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return MergerError(f"no credentials for the object store (set AWS_ACCESS_KEY_ID and "
                           f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), {url}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or \
            "Could not connect" in text:
        return MergerError(f"cannot reach the object store's endpoint (AWS_ENDPOINT_URL?), {url}")
    if any(code in text for code in ("SlowDown", "Throttl", "RequestLimitExceeded", "503")):
        return MergerError(f"the object store kept throttling after the client's retries, {url}")
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return MergerError(f"the object store refused {doing} ({name}{': ' + first if first else ''}), {url}")


class ObjectStorage:
    """One scheme's buckets. Keys are `bucket/key`, as fsspec names objects."""

    def __init__(self, scheme: str, url: str):
        self.scheme = scheme
        self.fs = _filesystem(scheme, url)
        self.blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.small: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.kinds: dict[str, str] = {}  # what listings showed: a folder's entries need no request each
        self.last: dict[str, int] = {}  # each file's block read last: whether a read goes on from there
        self.fetched = 0  # bytes GET so far, read ahead included
        self.lock = threading.Lock()

    def url(self, key: str) -> str:
        return f"{self.scheme}://{key}"

    def _call(self, key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every client error becomes one line, or FileNotFoundError
            raise _refusal(e, self.url(key)) from e

    def _info(self, key: str) -> dict:
        return self._call(key, self.fs.info, key)

    def identity(self, key: str) -> dict[str, int | str]:
        info = self._call(key, self.fs.info, key, refresh=True)
        if info.get("type") != "file":
            raise FileNotFoundError(self.url(key))
        # The ETag changes with every write of the object, its version id too where the bucket keeps versions.
        return {"size": int(info["size"]), "etag": str(info.get("ETag", "")),
                "version": str(info.get("VersionId") or "")}

    def size(self, key: str) -> int:
        if key not in self.sizes:
            info = self._info(key)
            if info.get("type") != "file":
                raise FileNotFoundError(self.url(key))
            self.sizes[key] = int(info["size"])
        return self.sizes[key]

    def list(self, key: str) -> list[Entry]:
        try:
            found = self._call(key, self.fs.ls, key, detail=True)
        except FileNotFoundError:
            return []
        prefix = key.rstrip("/") + "/"
        entries = {e["name"].rstrip("/")[len(prefix):]: e["type"] == "directory" for e in found
                   if e["name"].rstrip("/").startswith(prefix)}
        for e in found:
            if e["type"] == "file":
                self.sizes[e["name"]] = int(e["size"])
        self.kinds.update({prefix + n: "dir" if d else "file" for n, d in entries.items()})
        return sorted((Entry(n, d) for n, d in entries.items() if n and "/" not in n), key=lambda e: e.name)

    def kind(self, key: str) -> str | None:
        if key in self.kinds:
            return self.kinds[key]
        if not key.strip("/") or "/" not in key.strip("/"):
            # a bucket: there when it can be listed
            return "dir" if self._call(key, self.fs.exists, key) else None
        try:
            info = self._info(key)
        except FileNotFoundError:
            return None
        return "dir" if info.get("type") == "directory" else "file"

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if length is not None and length <= 0:
            return b""  # an empty range is no request (S3 refuses one)
        end = None if length is None else start + length
        data = self._call(key, self.fs.cat_file, key, start=start, end=end)
        self.fetched += len(data)
        return data

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        got = self._call(key, self.fs.cat_ranges, [key] * len(ranges), [a for a, _ in ranges],
                         [b for _, b in ranges], on_error="raise")
        for data in got:
            if isinstance(data, Exception):
                raise _refusal(data, self.url(key))
            self.fetched += len(data)
        return got

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        size = self.size(key)
        small = len(view) <= SMALL and (key, offset // BLOCK) not in self.blocks
        unit = SMALL if small else BLOCK
        done = 0
        while done < len(view) and offset + done < size:
            at = offset + done
            block = self._small_block(key, at // SMALL, size) if small else self._block(key, at // BLOCK, size)
            lo = at - (at // unit) * unit
            n = min(len(view) - done, len(block) - lo)
            if n <= 0:
                break
            view[done:done + n] = block[lo:lo + n]
            done += n
        return done

    def _small_block(self, key: str, index: int, size: int) -> bytes:
        """A block of SMALL bytes, for the small reads that find a piece (a DCP blob's zip directory and pickle, at
        its two ends): they neither fetch nor push out the large blocks the data is read from."""
        with self.lock:
            block = self.small.get((key, index))
            if block is None:
                block = self.small[(key, index)] = self.read(key, index * SMALL, min(SMALL, size - index * SMALL))
                while len(self.small) > KEEP_SMALL:
                    self.small.popitem(last=False)
            return block

    def _block(self, key: str, index: int, size: int) -> bytes:
        with self.lock:
            block = self.blocks.get((key, index))
            if block is not None:
                self.blocks.move_to_end((key, index))
                self.last[key] = index
                return block
            going_on = self.last.get(key) in (index - 1, index)
            self.last[key] = index
            wanted = [i for i in range(index, index + (READ_AHEAD if going_on else 1))
                      if i * BLOCK < size and (key, i) not in self.blocks]
            got = self.read_ranges(key, [(i * BLOCK, min(size, (i + 1) * BLOCK)) for i in wanted])
            for i, data in zip(wanted, got):
                self.blocks[(key, i)] = data
            while len(self.blocks) > KEEP:
                self.blocks.popitem(last=False)
            return self.blocks[(key, index)]

    def local_fd(self, key: str) -> None:
        return None

    def close(self) -> None:
        self.blocks.clear()
        self.small.clear()
