"""merger's object-store clients side by side with obstore (Rust object_store), on the reads and writes a merge
makes (issue 51 item 1).

    PYTHONPATH=/tmp/obstore-pkgs python benchmarks/object_store_clients.py [--store s3|az] [--objects 4]
        [--object_size 64MiB] [--in_flight 4] [--upload_size 512MiB] [--part_size 16MiB] [--uploaders 4]
        [--repeats 3] [--obstore_async]

obstore is not one of merger's dependencies: install it apart (`pip install --target /tmp/obstore-pkgs obstore`) and
put that folder on PYTHONPATH; without it the script measures merger's client alone and says why.

Against moto's S3 server (`--store s3`, as benchmarks/object_storage.py starts it) or Azurite (`--store az`, as
tests/helpers/emulators.py starts it), a process of its own on the loopback, in one run, each client in turn,
alternating (the order flips every repeat), after one untimed pass each that checks the bytes. The defaults are
merger's own: GETs of at most read_plan.BLOCK (8 MiB), FETCH // BLOCK (4) of them in flight, parts of
bucket_target.PART (16 MiB), UPLOADS_IN_FLIGHT (4) of them in flight per rank.
- ranged reads: `--objects` objects of `--object_size`, read in ranges of 1 MiB to BLOCK (a fixed draw), the objects
  taken in turn as a merge's plan jumps between files; one range at a time (fsspec's `cat_file`, obstore's
  `get_range`), then `--in_flight` ranges at once, a batch waited for before the next (merger's read-ahead: fsspec's
  `cat_ranges`; obstore's sync `get_range` from a thread each, or its `get_range_async` gathered on one asyncio
  loop with --obstore_async);
- an upload in parts of one `--upload_size` object in `--part_size` parts, `--uploaders` parts in flight: merger's
  writer for the store (object_writers.py: begin, upload_part from a thread pool, complete; S3's multipart upload,
  Azure's Put Block and Put Block List) against obstore's `put` (its only upload in parts: one process sends every
  part). Each client's first upload is read back whole and compared (MD5) with the bytes sent.
The floor, `raw HTTP`: the same requests through http.client, a kept-alive connection per thread and nothing else
(S3: URLs presigned by boto3, outside the timing for reads, inside it for the upload's calls; Azure: one container
SAS): what moving the bytes through a socket costs a client that does no more than that.
Per client and test: throughput (bytes / wall), the client's CPU seconds per GB (this process's user + system time,
every thread: aiobotocore's event loop and obstore's Rust runtime both run in it) and the server's (its process),
medians of `--repeats`, and the ratios. On the loopback the server runs on the same cores as the client, and moto
(Python) costs far more per byte than either client: the wall times mostly measure the server and the machine's
load, the client CPU per GB is what tells the clients apart. The load average is printed before and after.

It also tries what merger's target needs of a client beyond reads and uploads, against the same server: a put only
where no object is (the target's lock, If-None-Match), a listing under a prefix, and an upload in parts that several
processes share by its upload id (each rank sends its own parts, rank 0 completes: docs/object_storage.md).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import random
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import datetime, timedelta, timezone
from itertools import zip_longest
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.object_storage import ENV, start_server  # noqa: E402
from merger.io.read_plan import BLOCK, FETCH  # noqa: E402
from merger.output.bucket_target import PART, UPLOADS_IN_FLIGHT  # noqa: E402
from merger.units import format_size, parse_size  # noqa: E402

BUCKET = "clients"
MiB = 1 << 20


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, every thread."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def draw_ranges(objects: list[str], size: int, seed: int = 51) -> list[tuple[str, int, int]]:
    """Every byte of each object in ranges of 1 MiB to BLOCK (merger's largest GET), the objects in turn (range 1 of
    each, range 2 of each...): a tensor's piece ends a GET short of BLOCK."""
    rng = random.Random(seed)
    per_object = []
    for key in objects:
        spans, at = [], 0
        while at < size:
            end = min(size, at + rng.randint(1, BLOCK // MiB) * MiB)
            spans.append((key, at, end))
            at = end
        per_object.append(spans)
    return [r for row in zip_longest(*per_object) for r in row if r is not None]


def random_bytes(rng: random.Random, size: int) -> bytearray:
    """`size` bytes drawn by `rng`, 64 MiB at a time (randbytes takes at most 256 MiB)."""
    out = bytearray(size)
    for at in range(0, size, 64 * MiB):
        out[at:at + 64 * MiB] = rng.randbytes(min(64 * MiB, size - at))
    return out


class MergerClient:
    """merger's clients as merger builds them (its waits and retries: store_waits.py), the store's address from the
    environment, as merger finds it: reads through ObjectStorage's fsspec client, writes through the store's
    ObjectWriter (S3: botocore's calls; Azure: Put Block and Put Block List)."""
    NAMES = {"s3": "s3fs/botocore", "az": "adlfs/azure-storage-blob"}

    def __init__(self, scheme: str):
        from merger.io.object_store import ObjectStorage
        from merger.io.object_writers import object_writer

        self.name = self.NAMES[scheme]
        self.storage = ObjectStorage(scheme, f"{scheme}://{BUCKET}")
        self.fs = self.storage.fs
        self.writer = object_writer(f"{scheme}://{BUCKET}")

    def read_one(self, key: str, start: int, end: int) -> int:
        return len(self.fs.cat_file(f"{BUCKET}/{key}", start=start, end=end))

    def read_batches(self, batches: list[list[tuple[str, int, int]]]) -> list[list[bytes]]:
        return [self.fs.cat_ranges([f"{BUCKET}/{k}" for k, _, _ in batch], [a for _, a, _ in batch],
                                   [b for _, _, b in batch], on_error="raise") for batch in batches]

    def read_whole(self, key: str) -> bytes:
        return self.fs.cat_file(f"{BUCKET}/{key}")

    def upload(self, key: str, data: memoryview, part: int, uploaders: int) -> None:
        upload_id = self.writer.begin(key)
        with ThreadPoolExecutor(uploaders) as pool:
            etags = list(pool.map(lambda i: self.writer.upload_part(key, upload_id, i // part + 1, data[i:i + part]),
                                  range(0, len(data), part)))
        self.writer.complete(key, upload_id, etags)

    def remove(self, key: str) -> None:
        self.writer.remove([key])

    def create(self, key: str, data: bytes) -> bool:
        return self.writer.create(key, data)

    def listing(self, prefix: str) -> list[str]:
        return sorted(p.split("/", 1)[1] for p in self.fs.find(f"{BUCKET}/{prefix}", refresh=True))

    def shared_upload(self) -> str | None:
        """As ObstoreClient's: the calls by upload id that merger's writer makes (any process sends parts)."""
        calls = ("begin", "upload_part", "complete", "abort", "open_uploads")
        missing = [c for c in calls if not hasattr(self.writer, c)]
        return f"{type(self.writer).__name__} has no {', '.join(missing)}" if missing else None


class ObstoreClient:
    name = "obstore"

    def __init__(self, scheme: str, endpoint: str, use_async: bool = False):
        import obstore
        from obstore.store import AzureStore, S3Store

        self.obs = obstore
        self.use_async = use_async
        # obstore reads AWS_ENDPOINT_URL but not AZURE_STORAGE_CONNECTION_STRING: each store's address given here
        if scheme == "s3":
            self.store = S3Store(BUCKET, endpoint=endpoint, access_key_id=ENV["AWS_ACCESS_KEY_ID"],
                                 secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"], region=ENV["AWS_DEFAULT_REGION"],
                                 client_options={"allow_http": True})
        else:
            from tests.helpers.emulators import ACCOUNT, ACCOUNT_KEY

            self.store = AzureStore(BUCKET, account_name=ACCOUNT, account_key=ACCOUNT_KEY,
                                    endpoint=f"{endpoint}/{ACCOUNT}", client_options={"allow_http": True})

    def read_one(self, key: str, start: int, end: int) -> int:
        return len(self.obs.get_range(self.store, key, start=start, end=end))

    def read_batches(self, batches: list[list[tuple[str, int, int]]]) -> list[list]:
        if self.use_async:
            async def each():  # one event loop for them all, a batch awaited before the next is sent
                return [await asyncio.gather(*(self.obs.get_range_async(self.store, k, start=a, end=b)
                                               for k, a, b in batch)) for batch in batches]
            return asyncio.run(each())
        # Its sync calls release the GIL while its Rust runtime fetches: a thread per range in flight. (Its async
        # calls hold the GIL and are driven by Python's event loop: --obstore_async measures them.)
        with ThreadPoolExecutor(max(map(len, batches))) as pool:
            return [list(pool.map(lambda r: self.obs.get_range(self.store, r[0], start=r[1], end=r[2]), batch))
                    for batch in batches]

    def upload(self, key: str, data: memoryview, part: int, uploaders: int) -> None:
        self.obs.put(self.store, key, (data[i:i + part] for i in range(0, len(data), part)), use_multipart=True,
                     chunk_size=part, max_concurrency=uploaders)

    def create(self, key: str, data: bytes) -> bool:
        from obstore.exceptions import AlreadyExistsError

        try:
            self.obs.put(self.store, key, data, mode="create")
        except AlreadyExistsError:
            return False
        return True

    def listing(self, prefix: str) -> list[str]:
        return sorted(m["path"] for batch in self.obs.list(self.store, prefix=prefix) for m in batch)

    def shared_upload(self) -> str | None:
        """Why an upload cannot take parts from several processes, or None where it can: the upload id has to be
        begun, written to and completed by name (Rust object_store's MultipartStore), not only inside one put."""
        calls = ("create_multipart", "put_part", "complete_multipart")
        have = [c for c in calls if hasattr(self.obs, c) or hasattr(self.store, c)]
        if len(have) == len(calls):
            return None
        return (f"obstore {self.obs.__version__} (object_store {self.obs._object_store_version}) has no "
                f"{', '.join(c for c in calls if c not in have)} in Python: an upload's parts go through one put or "
                f"open_writer, in one process")


class RawHttpClient:
    """The floor: each request as one http.client call on a kept-alive connection of the calling thread, the body
    read into bytes, no retries, checksums or parsing beyond the upload id. Its requests are signed as cheaply as
    the store allows: S3 by presigned URLs (a read's computed once per object, before the timing; the upload's
    inside it, one HMAC each), Azure by one container SAS."""
    name = "raw HTTP (floor)"

    def __init__(self, scheme: str, endpoint: str):
        self.scheme, self.host = scheme, endpoint.split("//", 1)[1]
        self.local = threading.local()
        if scheme == "s3":
            import boto3

            self.s3 = boto3.client("s3")
            self.urls: dict[str, str] = {}
        else:
            from azure.storage.blob import ContainerSasPermissions, generate_container_sas
            from tests.helpers.emulators import ACCOUNT, ACCOUNT_KEY

            sas = generate_container_sas(ACCOUNT, BUCKET, account_key=ACCOUNT_KEY,
                                         expiry=datetime.now(timezone.utc) + timedelta(days=1),
                                         permission=ContainerSasPermissions(read=True, write=True, create=True))
            self.blob = lambda key, query="": f"/{ACCOUNT}/{BUCKET}/{quote(key)}?{query}{sas}"

    def _call(self, method: str, url: str, body=None, headers=None):
        import http.client

        for again in (True, False):
            if getattr(self.local, "conn", None) is None:
                self.local.conn = http.client.HTTPConnection(self.host)
            try:
                self.local.conn.request(method, url, body=body, headers=headers or {})
                response = self.local.conn.getresponse()
                data = response.read()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                # a server closes a kept-alive connection left idle (Azurite after 5 s): a new one, as urllib3 does
                self.local.conn.close()
                self.local.conn = None
                if not again:
                    raise
        if response.status >= 300:
            raise SystemExit(f"raw HTTP: {method} {url} answered {response.status}: {data[:200]!r}")
        return response, data

    def _signed(self, call: str, **params) -> str:
        url = self.s3.generate_presigned_url(call, Params={"Bucket": BUCKET, **params})
        return url.split(self.host, 1)[1]

    def _get(self, key: str, start: int, end: int) -> bytes:
        if self.scheme == "s3":
            url = self.urls.get(key) or self.urls.setdefault(key, self._signed("get_object", Key=key))
        else:
            url = self.blob(key)
        return self._call("GET", url, headers={"Range": f"bytes={start}-{end - 1}"})[1]

    def sign_reads(self, keys: list[str]) -> None:
        if self.scheme == "s3":
            for key in keys:
                self._get(key, 0, 1)

    def read_one(self, key: str, start: int, end: int) -> int:
        return len(self._get(key, start, end))

    def read_batches(self, batches: list[list[tuple[str, int, int]]]) -> list[list[bytes]]:
        with ThreadPoolExecutor(max(map(len, batches))) as pool:
            return [list(pool.map(lambda r: self._get(*r), batch)) for batch in batches]

    def upload(self, key: str, data: memoryview, part: int, uploaders: int) -> None:
        starts = range(0, len(data), part)
        if self.scheme == "s3":
            body = self._call("POST", self._signed("create_multipart_upload", Key=key))[1]
            upload_id = re.search(rb"<UploadId>(.+?)</UploadId>", body).group(1).decode()

            def send(at: int) -> str:
                url = self._signed("upload_part", Key=key, UploadId=upload_id, PartNumber=at // part + 1)
                return self._call("PUT", url, body=data[at:at + part])[0].getheader("ETag")
            with ThreadPoolExecutor(uploaders) as pool:
                etags = list(pool.map(send, starts))
            listing = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>"
                              for n, e in enumerate(etags, 1))
            self._call("POST", self._signed("complete_multipart_upload", Key=key, UploadId=upload_id),
                       body=f"<CompleteMultipartUpload>{listing}</CompleteMultipartUpload>".encode())
            return
        ids = [base64.b64encode(f"{n:05d}".encode()).decode() for n in range(len(starts))]
        with ThreadPoolExecutor(uploaders) as pool:
            list(pool.map(lambda n: self._call("PUT", self.blob(key, f"comp=block&blockid={quote(ids[n])}&"),
                                               body=data[starts[n]:starts[n] + part]), range(len(starts))))
        listing = "".join(f"<Latest>{i}</Latest>" for i in ids)
        self._call("PUT", self.blob(key, "comp=blocklist&"),
                   body=f'<?xml version="1.0" encoding="utf-8"?><BlockList>{listing}</BlockList>'.encode())


@contextmanager
def serving(store: str):
    """The store's server on the loopback, in a process of its own, with the bucket made and the environment set
    as merger's clients find it: its process id, its address, and a function putting an object."""
    import psutil

    if store == "s3":
        import boto3

        server, endpoint = start_server()
        os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
        try:
            s3 = boto3.client("s3")
            s3.create_bucket(Bucket=BUCKET)
            yield server.pid, endpoint, lambda key, data: s3.put_object(Bucket=BUCKET, Key=key, Body=data)
        finally:
            server.terminate()
            server.wait()
        return
    from tests.helpers.emulators import AZURITE, azurite, node_missing

    if node_missing() or not AZURITE.exists():
        raise SystemExit(f"az needs Azurite: {node_missing() or 'make azurite installs it'}")
    with azurite() as az:
        os.environ.update(az.env)
        pid = next(p.pid for p in psutil.Process().children() if "azurite" in " ".join(p.cmdline()))
        container = az.bucket(BUCKET)
        yield pid, az.endpoint, lambda key, data: container.upload_blob(key, data, overwrite=True)


def timed(client_pid: int, server_pid: int, fn) -> tuple[float, float, float]:
    """Wall seconds, this process's CPU seconds and the server's, of fn()."""
    cpu0, srv0, t0 = cpu_of(client_pid), cpu_of(server_pid), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return wall, cpu_of(client_pid) - cpu0, cpu_of(server_pid) - srv0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", choices=("s3", "az"), default="s3",
                   help="s3: moto's server; az: Azurite (`make azurite` installs it; node and npm needed)")
    p.add_argument("--objects", type=int, default=4)
    p.add_argument("--object_size", default="64MiB", help="each read object's size")
    p.add_argument("--in_flight", type=int, default=FETCH // BLOCK,
                   help="ranges in flight together (merger: FETCH // BLOCK, 4 GETs of at most 8 MiB)")
    p.add_argument("--upload_size", default="512MiB",
                   help="moto spends some 10 CPU s per GB taking parts: 512 MiB keeps the run near 3 minutes")
    p.add_argument("--part_size", default=format_size(PART), help="merger's upload parts (bucket_target.PART)")
    p.add_argument("--uploaders", type=int, default=UPLOADS_IN_FLIGHT,
                   help="parts in flight together (merger: UPLOADS_IN_FLIGHT per rank)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--obstore_async", action="store_true",
                   help="obstore's ranges in flight through its async API (get_range_async on one asyncio loop) "
                        "instead of its sync calls from a thread each")
    args = p.parse_args()
    object_size, upload_size, part = (parse_size(args.object_size), parse_size(args.upload_size),
                                      parse_size(args.part_size))

    load_before = os.getloadavg()
    with ExitStack() as stack:
        server_pid, endpoint, put = stack.enter_context(serving(args.store))
        rng = random.Random(0)
        objects = {f"read/{i}.bin": bytes(random_bytes(rng, object_size)) for i in range(args.objects)}
        for key, data in objects.items():
            put(key, data)
        ranges = draw_ranges(list(objects), object_size)
        batches = [ranges[i:i + args.in_flight] for i in range(0, len(ranges), args.in_flight)]
        payload = memoryview(random_bytes(rng, upload_size))
        want = hashlib.md5(payload).digest()

        merger_client = MergerClient(args.store)
        floor = RawHttpClient(args.store, endpoint)
        floor.sign_reads(list(objects))
        clients = [merger_client]
        try:
            clients.append(ObstoreClient(args.store, endpoint, args.obstore_async))
        except ImportError as e:
            print(f"obstore skipped: it is not installed here ({e}); pip install --target DIR obstore and put DIR "
                  f"on PYTHONPATH")

        # Untimed: every range's bytes as uploaded, and what merger's target asks beyond reads and uploads
        features = {}
        for c in [*clients, floor]:
            for key, a, b in ranges[:8]:
                if bytes(c.read_batches([[(key, a, b)]])[0][0]) != objects[key][a:b]:
                    raise SystemExit(f"{c.name} read wrong bytes from {key} [{a}, {b})")
            if c is floor:
                continue
            created = [c.create(f"lock/{c.name.replace('/', '-')}", b"one"),
                       c.create(f"lock/{c.name.replace('/', '-')}", b"two")]
            features[c.name] = {
                "ranged reads": "yes",
                "put only where none is (If-None-Match)": "yes" if created == [True, False] else f"no ({created})",
                "listing under a prefix": "yes" if c.listing("read") == sorted(objects) else "no",
                "upload id shared by processes": c.shared_upload() or "yes",
            }

        tests = {
            f"ranged reads, one at a time ({format_size(object_size * args.objects)})":
                (object_size * args.objects, lambda c: [c.read_one(*r) for r in ranges]),
            f"ranged reads, {args.in_flight} in flight":
                (object_size * args.objects, lambda c: c.read_batches(batches)),
            f"multipart upload of {format_size(upload_size)}, {format_size(part)} parts, {args.uploaders} in flight":
                (upload_size, None),
        }
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        timed_clients = [*clients, floor]
        for repeat in range(args.repeats):
            for name, (size, fn) in tests.items():
                for c in timed_clients if repeat % 2 == 0 else timed_clients[::-1]:
                    if fn is None:
                        key = f"upload/{c.name.replace('/', '-')}-{repeat}.bin"
                        run = timed(os.getpid(), server_pid, lambda: c.upload(key, payload, part, args.uploaders))
                        if repeat == 0 and hashlib.md5(merger_client.read_whole(key)).digest() != want:
                            raise SystemExit(f"{c.name}'s upload does not read back as the bytes sent")
                        merger_client.remove(key)  # both servers hold objects in memory
                    else:
                        run = timed(os.getpid(), server_pid, lambda: fn(c))
                    results.setdefault((name, c.name), []).append(run)
        load_after = os.getloadavg()

        gb = 1e9
        server_name = "moto" if args.store == "s3" else "Azurite"
        print(f"\n{server_name} on the loopback ({endpoint}), {os.cpu_count()} cores, load average "
              f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in load_after)} after; "
              f"medians of {args.repeats}, the clients alternating\n")
        print("| test | client | throughput | client CPU s / GB | server CPU s / GB |\n|---|---|---|---|---|")
        medians = {}
        for (name, client), runs in results.items():
            size = tests[name][0]
            wall, cpu, srv = (statistics.median(r[i] for r in runs) for i in range(3))
            medians[(name, client)] = (size / wall, cpu * gb / size)
            print(f"| {name} | {client} | {size / wall / gb:.3f} GB/s | {cpu * gb / size:.2f} | "
                  f"{srv * gb / size:.2f} |")
        # Each client's CPU per GB over the floor's: what it spends beyond moving the bytes through a socket
        base, other = clients[0].name, clients[-1].name
        head = f"| test | {base} CPU/GB / floor's |"
        if len(clients) > 1:
            head += f" {other} CPU/GB / floor's | throughput {other} / {base} | CPU/GB {base} / {other} |"
        print(f"\n{head}\n|---|" + "---|" * (head.count("|") - 2))
        for name in tests:
            (tb, cb), (to, co), (_, cf) = (medians[(name, n)] for n in (base, other, floor.name))
            row = f"| {name} | {cb / cf:.2f}x |"
            if len(clients) > 1:
                row += f" {co / cf:.2f}x | {to / tb:.2f}x | {cb / co:.2f}x |"
            print(row)
        print("\n| what merger's target needs | " + " | ".join(c.name for c in clients) + " |\n|---|"
              + "---|" * len(clients))
        for feature in next(iter(features.values())):
            print(f"| {feature} | " + " | ".join(features[c.name][feature] for c in clients) + " |")


if __name__ == "__main__":
    main()
