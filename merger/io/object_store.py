"""Objects in a bucket (s3://, and gs:// or az:// where gcsfs or adlfs is installed), through fsspec.

Credentials, region and endpoint come from the client library's standard environment and files
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/config...; GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST;
AZURE_STORAGE_CONNECTION_STRING...): merger takes none of its own and prints none.

A merge rank reads each piece front to back, a megabyte at a time. One GET per megabyte would spend the merge
on request latency, so reads are served from bytes fetched ahead, FETCH bytes (GETs of at most BLOCK) in
flight together, and at most HELD bytes are held per process.

What to fetch ahead: the merge says which byte ranges it reads next, in its order (`will_read`, a batch's pieces).
A read that misses fetches its planned range and those after it in the plan, whatever their files, and only
them: one rank reading two files whose pieces the output order interleaves fetches each byte about once, where
reading ahead block by block in each file fetched blocks that the other file's reads pushed out before they
were used (1.25x the source on one rank). Reads outside the plan (a record's padding read for its CRC-32,
`inspect --check`) keep the block rule: a read that goes on from where the file's last one was fetches
READ_AHEAD blocks, one that jumps elsewhere its own block only.
"""
from __future__ import annotations

import bisect
import errno
import logging
import threading
import warnings
from collections import OrderedDict

from ..errors import CredentialsError, MergerError, StoreUnavailableError
from .read_plan import BLOCK, FETCH, SMALL, Plan
from .store_waits import store_filesystem
from .storage import Entry

READ_AHEAD = FETCH // BLOCK  # blocks a read outside the plan that goes on from the last one fetches: 32 MiB
HELD = 2 * FETCH  # bytes held per process, at most (64 MiB): what the last miss fetched, and the one before


# The client libraries log at INFO where they found the credentials and the endpoint: not merger's progress.
for _name in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "adlfs", "azure"):
    logging.getLogger(_name).setLevel(logging.WARNING)
# gcsfs logs the error it gives up on, traceback and all, as it raises it: merger says it, in one line
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
# adlfs warns when it cannot read a container's properties and goes on; the listing that follows says why, in one line
warnings.filterwarnings("ignore", message="Failed to fetch container properties", module="adlfs")

# Where each scheme's client library looks for its credentials and endpoint: said in the lines that concern them.
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
EXTRAS = {"s3fs": "s3", "gcsfs": "gs", "adlfs": "az"}
CREDENTIALS = {"s3fs": "AWS_ACCESS_KEY_ID, AWS_PROFILE...", "gcsfs": "GOOGLE_APPLICATION_CREDENTIALS...",
               "adlfs": "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY..."}
ENDPOINTS = {"s3fs": "AWS_ENDPOINT_URL", "gcsfs": "STORAGE_EMULATOR_HOST",
             "adlfs": "the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING"}
THROTTLING = {"s3fs": "503 SlowDown", "gcsfs": "429 or 503", "adlfs": "503 ServerBusy"}  # each store's answer


def _filesystem(scheme: str, url: str):
    try:
        # a client of its own, with merger's waits and retries, not the libraries' defaults (store_waits.py)
        return store_filesystem(scheme)
    except ImportError as e:
        package = PACKAGES.get(scheme, "adlfs")
        raise MergerError(f"{scheme}:// needs the {package} package (pip install "
                          f"'merger[{EXTRAS[package]}]'), {url}") from e
    except ValueError as e:
        if PACKAGES.get(scheme) == "adlfs":  # adlfs found no account named anywhere, so nothing to connect with
            raise CredentialsError(f"no credentials for the object store (set "
                                   f"{CREDENTIALS[PACKAGES[scheme]]}), {url}") from e
        raise MergerError(f"unknown storage {scheme}:// (s3://, gs:// and az:// are known), {url}") from e


# What the client libraries raise when an answer breaks off: a reset, a stall past the read timeout, a body shorter
# than its Content-Length (aiohttp's, botocore's, s3fs's, azure-core's names for them).
BROKEN = ("ClientPayloadError", "IncompleteRead", "IncompleteReadError", "ResponseStreamingError",
          "ReadTimeoutError", "ConnectionClosedError", "ServerDisconnectedError", "ClientOSError", "FSTimeoutError",
          "TimeoutError", "ConnectionResetError", "ServerTimeoutError", "SocketTimeoutError", "ServiceResponseError")


def _causes(e: BaseException) -> list[str]:
    """The class names of `e` and of the errors it was raised from: azure-storage-blob gives up on a body that kept
    breaking off with an HttpResponseError raised from the last break."""
    names = []
    while e is not None and len(names) < 8:
        names.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    return names


def _refusal(e: Exception, url: str, doing: str = "a read") -> Exception:
    """What the store's error means, as one line naming `url`; FileNotFoundError passes through for the caller.
    Never the credentials: the known cases are said in merger's words; any other shows the error's class and the
    first line of the store's message, which names the request, not the keys that signed it."""
    if isinstance(e, (FileNotFoundError, MergerError)):
        return e
    name = type(e).__name__
    text = str(e)
    package = PACKAGES.get(url.split("://", 1)[0], "s3fs")
    # status_code: azure-core's HttpResponseError; code: gcsfs's HttpError (gcsfs says 403 as "Forbidden")
    status = getattr(e, "status_code", None) or getattr(e, "code", None)
    if isinstance(e, PermissionError) or status in (401, 403) or \
            any(code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden",
                                          "AuthorizationFailure", "AuthenticationFailed")):
        return CredentialsError(f"access denied by the object store (check the credentials: "
                                f"{CREDENTIALS[package]}), {url}")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return CredentialsError(f"no credentials for the object store (set AWS_ACCESS_KEY_ID and "
                                f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), {url}")
    if name == "DefaultCredentialsError":  # google-auth found none
        return CredentialsError(f"no credentials for the object store (set GOOGLE_APPLICATION_CREDENTIALS), {url}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ClientConnectorDNSError",
                "ServiceRequestError") or "Could not connect" in text:
        return MergerError(f"cannot reach the object store's endpoint ({ENDPOINTS[package]}?), {url}")
    # s3fs turns SlowDown into OSError(EBUSY, "Please reduce your request rate."); gcsfs's 429 and azure's 503
    # ServerBusy keep their status
    if (isinstance(e, OSError) and e.errno == errno.EBUSY) or status in (429, 503) or \
            any(code in text for code in ("SlowDown", "reduce your request rate", "Throttl", "RequestLimitExceeded",
                                          "503", "ServerBusy")):
        return StoreUnavailableError(f"the object store kept throttling ({THROTTLING[package]}) after the client's "
                                     f"retries, {url}")
    if set(_causes(e)) & set(BROKEN):
        return StoreUnavailableError(f"{doing} failed after the client's retries: the object store's answers broke "
                                     f"off (connection reset, stalled past the read timeout, or cut short), {url}")
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return MergerError(f"the object store refused {doing} ({name}{': ' + first if first else ''}), {url}")


class ObjectStorage:
    """One scheme's buckets. Keys are `bucket/key`, as fsspec names objects."""

    def __init__(self, scheme: str, url: str):
        self.scheme = scheme
        self.fs = _filesystem(scheme, url)
        # Bytes fetched: (key, start) -> the bytes from there, HELD bytes at most, the first fetched pushed out first:
        # fetched in the plan's order, they are read in it. (Least recently used first pushed out bytes fetched ahead
        # and not read yet before those read already.)
        self.held: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.held_bytes = 0
        self.starts: dict[str, list[int]] = {}  # each key's held starts, sorted
        self.plan = Plan([])  # the ranges the merge reads next (`will_read`)
        self.sizes: dict[str, int] = {}
        self.kinds: dict[str, str] = {}  # what listings showed: a folder's entries need no request each
        self.last: dict[str, int] = {}  # each file's block read last outside the plan: whether a read goes on
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
        # asked of the store, not of the listings held: gcsfs answers info() from them, refresh or not
        self.fs.invalidate_cache(key)
        info = self._call(key, self.fs.info, key, refresh=True)
        if info.get("type") != "file":
            raise FileNotFoundError(self.url(key))
        # The ETag changes with every write of the object, its version id too where the bucket keeps versions (the
        # names s3fs, gcsfs and adlfs give them: GCS's generation is a version that every write changes)
        return {"size": int(info["size"]), "etag": str(info.get("ETag") or info.get("etag") or ""),
                "version": str(info.get("VersionId") or info.get("generation") or info.get("version_id") or "")}

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
            # a bucket: there when it can be listed. exists() also says False for one the credentials may not
            # read; the listing then says why (access denied), and only a missing bucket is None
            if self._call(key, self.fs.exists, key):
                return "dir"
            try:
                self._call(key, self.fs.ls, key, refresh=True)
            except FileNotFoundError:
                return None
            return "dir"
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
        return self._whole(key, start, end, data)

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return self._get([(key, a, b) for a, b in ranges])

    def _get(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of each (key, start, end), the requests in flight together."""
        if not requests:
            return []
        got = self._call(requests[0][0], self.fs.cat_ranges, [k for k, _, _ in requests],
                         [a for _, a, _ in requests], [b for _, _, b in requests], on_error="raise")
        for (key, start, end), data in zip(requests, got):
            if isinstance(data, Exception):
                raise _refusal(data, self.url(key))
            self.fetched += len(data)
            self._whole(key, start, end, data)
        return got

    def _whole(self, key: str, start: int, end: int | None, data: bytes) -> bytes:
        """`data`, checked to be every byte of [start, end) of `key` (end clipped to the object's size): a body cut
        short is never taken for the object's bytes. The HTTP layer catches a body shorter than its Content-Length
        (and the client retries it); this catches a response whose Content-Length itself falls short."""
        size = self.size(key)
        want = max(0, min(size if end is None else end, size) - start)
        if len(data) != want:
            raise MergerError(f"the object store sent {len(data)} bytes for bytes {start} to {start + want} of the "
                              f"object (a response cut short), {self.url(key)}")
        return data

    def will_read(self, ranges: list[tuple[str, int, int]]) -> None:
        with self.lock:
            self.plan = Plan(ranges)

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        size = self.size(key)
        end = min(size, offset + len(view))
        at = offset
        with self.lock:
            while at < end:
                data, lo = self._find(key, at) or self._fetch_for(key, at, len(view) <= SMALL, size)
                n = min(end - at, len(data) - lo)
                view[at - offset:at - offset + n] = memoryview(data)[lo:lo + n]
                at += n
            if at > offset:
                self.last[key] = (at - 1) // BLOCK
        return at - offset

    def _find(self, key: str, at: int) -> tuple[bytes, int] | None:
        """Held bytes of `key` holding byte `at`, and its place in them."""
        starts = self.starts.get(key, [])
        i = bisect.bisect_right(starts, at)
        for start in reversed(starts[max(0, i - 4):i]):  # held spans may overlap: a few back suffice
            data = self.held[(key, start)]
            if at < start + len(data):
                return data, at - start
        return None

    def _fetch_for(self, key: str, at: int, small: bool, size: int) -> tuple[bytes, int]:
        """Fetch what a read that missed at byte `at` of `key` needs and what is read after it; the bytes holding
        `at`, and its place in them."""
        requests = self.plan.after(key, at)
        if requests is None:  # outside the plan
            if small:
                start = at // SMALL * SMALL
                requests = [(key, start, min(size, start + SMALL))]
            else:
                index = at // BLOCK
                going_on = self.last.get(key) in (index - 1, index)
                requests = [(key, i * BLOCK, min(size, (i + 1) * BLOCK))
                            for i in range(index, index + (READ_AHEAD if going_on else 1)) if i * BLOCK < size]
                requests = [r for i, r in enumerate(requests) if i == 0 or self._find(key, r[1]) is None]
        got = self._get(requests)
        while self.held and self.held_bytes + sum(map(len, got)) > HELD:
            (gone, gone_at), data = self.held.popitem(last=False)
            self.starts[gone].remove(gone_at)
            self.held_bytes -= len(data)
        for (k, start, _), data in zip(requests, got):
            if (k, start) in self.held:
                self.held_bytes -= len(self.held[(k, start)])
            else:
                bisect.insort(self.starts.setdefault(k, []), start)
            self.held[(k, start)] = data
            self.held_bytes += len(data)
        return next((data, at - start) for (k, start, end), data in zip(requests, got)
                    if k == key and start <= at < start + len(data))

    def local_fd(self, key: str) -> None:
        return None

    def close(self) -> None:
        self.held.clear()
        self.starts.clear()
        self.held_bytes = 0
        self.plan = Plan([])
