"""A real S3-protocol server (moto's) on the loopback, and checkpoints uploaded to it: what the object-storage
tests read. Clients find it through the standard environment (`env`), as they would find AWS."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.processes import start_merger
from tests.helpers.reliability import wait_paused

# Made-up credentials the server accepts; the tests check that neither ever reaches merger's output.
KEY_ID = "AKIAMERGERTESTKEY000"
SECRET = "merger-test-secret-0123456789abcdefSECRET"

# The flags of the bucket tests' merges that are paused mid-stream (paused_merge): files of 20 MB, two upload parts
# each, written in batches of 16 MB, so a merge paused after a batch has sent parts and completed no upload (rank 0
# completes them all after the last batch).
STREAMED = ("--dtype", "float32", "--max_shard_size", "20MB", "--max_inflight", "16MB")


@dataclass
class ObjectStore:
    endpoint: str
    scheme = "s3"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY_ID,
                            aws_secret_access_key=SECRET, region_name="us-east-1")

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        return upload_folder(self.client(), folder, bucket, prefix)


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> str:
    """Every file below `folder` as an object under s3://bucket/prefix/ (the bucket made if missing); its URL."""
    if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def download(store: ObjectStore, prefix: str, into: Path, bucket: str = "models") -> list[str]:
    """Every object under s3://bucket/prefix/ into a folder; their names."""
    client = store.client()
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) + 1:]
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(into / name))
            names.append(name)
    return sorted(names)


def open_uploads(store: ObjectStore, bucket: str = "models") -> list[str]:
    """The keys of the multipart uploads begun in `bucket` and neither completed nor aborted."""
    return [u["Key"] for u in store.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@contextmanager
def moto_server():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield ObjectStore(f"http://{host}:{port}")
    finally:
        server.stop()


@contextmanager
def paused_merge(store_env: dict, model: Path, url: str, stage: Path | None, pause: Path, env: dict | None = None,
                 flags: tuple = ()):
    """A merge into the bucket `url` paused after its 6th batch, once some files' parts are sent (paused_merger.py);
    killed on the way out if the test left it running (a failed check would leave it paused for an hour). `stage`
    None: no --stage_dir (a temporary folder)."""
    env = {**store_env, "MERGER_TEST_PAUSE_AFTER_BATCH": "5", "MERGER_TEST_PAUSE_FILE": str(pause), **(env or {})}
    staged = ["--stage_dir", stage] if stage else []
    proc = start_merger("merge", "--local_dir", model, "--target_dir", url, *staged, *STREAMED, *flags, env=env)
    try:
        wait_paused([proc], pause, [0])
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
