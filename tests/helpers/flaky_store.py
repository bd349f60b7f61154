"""A fault-injecting HTTP forwarder on the loopback, put between merger and the tests' object stores (moto's S3
server, the GCS emulator, Azurite): what an object store under load does to its clients, on purpose and
reproducibly.

Each request of a faulted kind (an object's GET, ranged or whole; the writes of a bucket target: S3's PutObject,
CreateMultipartUpload, UploadPart, CompleteMultipartUpload; GCS's uploads and composes; Azure's Put Blob, Put Block
and Put Block List) is faulted with probability `rate`, one fault drawn from `faults`:
- "throttle": answered by the proxy with the store's throttling answer, never reaching the store (S3's 503
  SlowDown, GCS's 429 rateLimitExceeded, Azure's 503 ServerBusy);
- "reset": forwarded, then the connection is reset (RST) halfway through the response's body (at once where the
  body is empty): the store acted, the client never learns it;
- "stall": forwarded, then the response stops halfway for `stall_s` seconds (longer than the client's read
  timeout), then the connection is closed;
- "truncate": forwarded, then the response promises its whole Content-Length, sends half the bytes and closes the
  connection cleanly (FIN);
- "short" (not among the default faults: a broken store, not a flaky one): forwarded, then half the body is sent
  with a Content-Length that says half, so that the HTTP layer finds nothing wrong.

Deterministic: whether a request is faulted depends only on the seed, the request (method, path, query without
the random ids of S3's uploads, Azure's blocks and GCS's uploaded names, the range asked for) and how many times
that request came before, never on the order threads send requests in; so a retry draws anew, and a merge run
twice with the same seed meets the same faults.
`where(kind, path)` narrows the faults to some requests (one object, one operation); `limit` faults each request
that many times at most (rate 1 and limit 1: each one's first send fails, its retry goes through).
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("throttle", "reset", "stall", "truncate")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "upgrade", "te",
              "content-length"}


def s3_kind(method: str, target: str) -> str | None:
    """Which S3 operation a request is, among those faulted; None for the others (listings, HEAD, DELETE...)."""
    parts = urlsplit(target)
    query = {q.split("=", 1)[0] for q in parts.query.split("&") if q}
    on_object = "/" in parts.path.strip("/")
    if method == "GET" and on_object and not query & {"uploads", "uploadId", "list-type", "tagging", "acl"}:
        return "read"
    if method == "PUT" and on_object:
        return "upload_part" if "partNumber" in query else ("put_object" if not query else None)
    if method == "POST" and on_object:
        return "create_multipart" if "uploads" in query else ("complete_multipart" if "uploadId" in query else None)
    return None


def gcs_kind(method: str, target: str) -> str | None:
    """"read" for an object's download (its JSON API's media GET, ranged or whole), "upload" for an object's upload,
    "compose" for a compose; None for the rest (metadata, listings, deletes)."""
    path = urlsplit(target).path
    if method == "GET" and path.startswith("/download/storage/v1/b/"):
        return "read"
    if method == "POST" and path.startswith("/upload/storage/v1/b/"):
        return "upload"
    return "compose" if method == "POST" and path.endswith("/compose") else None


def azure_kind(method: str, target: str) -> str | None:
    """"read" for a blob's GET (/account/container/blob, ranged or whole); "put_blob", "put_block" and
    "put_block_list" for its writes; None for the rest (listings and properties: a query with comp or restype;
    HEAD; deletes)."""
    parts = urlsplit(target)
    query = dict(q.split("=", 1) for q in parts.query.split("&") if "=" in q)
    on_blob = parts.path.strip("/").count("/") >= 2
    if not on_blob:
        return None
    if method == "GET":
        return "read" if not query.keys() & {"comp", "restype"} else None
    if method == "PUT":
        return {None: "put_blob", "block": "put_block", "blocklist": "put_block_list"}.get(query.get("comp"))
    return None


@dataclass(frozen=True)
class Protocol:
    kind: Callable[[str, str], str | None]  # (method, target) -> the faulted kind of request, or None
    throttle: tuple[int, list[tuple[str, str]], bytes]  # the store's throttling answer: status, headers, body
    range_header: str  # where a ranged GET names its bytes


PROTOCOLS = {
    "s3": Protocol(s3_kind, (503, [("Content-Type", "application/xml")],
                             b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                             b"<Message>Please reduce your request rate.</Message></Error>"), "Range"),
    "gs": Protocol(gcs_kind, (429, [("Content-Type", "application/json")], json.dumps({"error": {
        "code": 429, "message": "The rate of requests exceeds the rate limit.",
        "errors": [{"reason": "rateLimitExceeded"}]}}).encode()), "Range"),
    "az": Protocol(azure_kind, (503, [("Content-Type", "application/xml"), ("x-ms-error-code", "ServerBusy")],
                                b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
                                b"<Message>The server is busy.</Message></Error>"), "x-ms-range"),
}


class FlakyProxy:
    def __init__(self, upstream: str, rate: float, faults=FAULTS, where=None, limit: int | None = None,
                 seed: int = 0, stall_s: float = 4.0, store: str = "s3"):
        self.upstream = urlsplit(upstream)
        self.protocol = PROTOCOLS[store]
        self.rate, self.faults, self.where, self.limit = rate, tuple(faults), where, limit
        self.seed, self.stall_s = seed, stall_s
        self.seen: Counter = Counter()  # request -> times it came
        self.faulted: Counter = Counter()  # request -> times it was faulted
        self.requests: Counter = Counter()  # kind -> requests of that kind
        self.injected: Counter = Counter()  # (kind, fault) -> faults injected
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # ends the stalls when the proxy stops
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def draw(self, request_kind: str | None, path: str, request: tuple) -> str | None:
        if request_kind is None or (self.where is not None and not self.where(request_kind, path)):
            return None
        with self.lock:
            self.requests[request_kind] += 1
            n = self.seen[request]
            self.seen[request] += 1
            rng = random.Random(f"{self.seed}/{request}/{n}")
            fault = rng.choice(self.faults) if rng.random() < self.rate else None
            if self.limit is not None and self.faulted[request] >= self.limit:
                fault = None
            if fault:
                self.faulted[request] += 1
                self.injected[(request_kind, fault)] += 1
        return fault

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and Expect: 100-continue answered as botocore expects
    owner: FlakyProxy

    def log_message(self, *args) -> None:  # a line per request otherwise
        pass

    def do_GET(self):
        self._forward()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _forward(self) -> None:
        proxy = self.owner
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        target = urlsplit(self.path)
        # the ids drawn anew each run (S3's upload id, Azure's block id, a GCS upload's object name, which holds the
        # upload id of merger's part objects) left out, so a seed meets the same requests every run
        query = sorted(q for q in target.query.split("&")
                       if q and not q.startswith(("uploadId=", "blockid=", "name=")))
        request = (self.command, target.path, tuple(query), self.headers.get(proxy.protocol.range_header, ""))
        fault = proxy.draw(proxy.protocol.kind(self.command, self.path), target.path, request)
        if fault == "throttle":
            self._respond(*proxy.protocol.throttle)
            return
        upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
        try:
            upstream.request(self.command, self.path, body,
                             {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP})
            response = upstream.getresponse()
            data = response.read()
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
            status, length = response.status, response.getheader("Content-Length")

        finally:
            upstream.close()
        if fault == "short":
            self._respond(status, headers, data[:len(data) // 2])
            return
        if fault is None:  # a HEAD's Content-Length is the object's, with no body
            self._respond(status, headers, data, length if self.command == "HEAD" else None)
            return
        self.close_connection = True
        half = len(data) // 2
        if data:  # the headers and half the body, then the fault; an empty body is lost whole
            self.send_response_only(status)
            for k, v in headers + [("Content-Length", str(len(data)))]:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data[:half])
            self.wfile.flush()
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif fault == "stall":
            proxy.stopping.wait(proxy.stall_s)
        # "truncate": the connection closes here with the body cut short

    def _respond(self, status: int, headers, data: bytes, length: str | None = None) -> None:
        self.send_response_only(status)
        for k, v in headers + [("Content-Length", length or str(len(data)))]:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


@contextmanager
def flaky_proxy(upstream: str, rate: float, **kwargs):
    proxy = FlakyProxy(upstream, rate, **kwargs)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
