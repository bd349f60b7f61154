"""The GCS and Azure Blob emulators on the loopback (gcp-storage-emulator's and Azurite), and checkpoints uploaded
to them with Google's and Microsoft's own client libraries: what the gs:// and az:// tests read, as moto's server
is for s3:// (tests/helpers/object_store.py). Clients find them through the standard environment (`env`)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.processes import free_port

# The session fixture that serves each scheme (tests/conftest.py): a test of any store asks for the one it needs.
SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}

# Azurite's one account, with the key every Azure storage emulator publishes (not a secret): Azurite checks it.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Where `make azurite` installs it (Makefile): an ignored folder of the repository.
AZURITE = Path(__file__).resolve().parents[2] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


@dataclass
class GcsEmulator:
    endpoint: str
    scheme = "gs"

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GOOGLE_CLOUD_PROJECT": "merger-test"}

    def bucket(self, name: str):
        """Google's client of bucket `name`, made if missing."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="merger-test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.endpoint})
        return client.lookup_bucket(name) or client.create_bucket(name)

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file below `folder` as an object under gs://bucket/prefix/ (the bucket made if missing); its URL."""
        target = self.bucket(bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                target.blob(f"{prefix}/{path.relative_to(folder).as_posix()}").upload_from_filename(str(path))
        return f"gs://{bucket}/{prefix}"

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.bucket(bucket).blob(key).upload_from_string(data)

    def names(self, bucket: str, prefix: str) -> list[str]:
        """The objects under gs://bucket/prefix/, by name below the prefix."""
        return sorted(b.name[len(prefix) + 1:] for b in self.bucket(bucket).list_blobs(prefix=f"{prefix}/"))

    def download(self, bucket: str, prefix: str, into: Path) -> list[str]:
        """Every object under gs://bucket/prefix/ into a folder; their names."""
        names = self.names(bucket, prefix)
        for name in names:
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(self.bucket(bucket).blob(f"{prefix}/{name}").download_as_bytes())
        return names

    def unfinished(self, bucket: str, prefix: str) -> list[str]:
        """The parts of uploads not yet composed into their files (merger's GcsWriter keeps them as objects below
        the target's .merger-parts/), once there are some (none after a minute)."""
        return _once_some(lambda: [n for n in self.names(bucket, prefix) if n.startswith(".merger-parts/")])


def _once_some(found) -> list[str]:
    """What `found()` returns once it is not empty, or [] after a minute: a paused merge's upload threads may still
    be sending the parts queued before the pause."""
    deadline = time.monotonic() + 60
    while True:
        names = found()
        if names or time.monotonic() > deadline:
            return names
        time.sleep(0.1)


@dataclass
class Azurite:
    endpoint: str
    scheme = "az"

    def connection_string(self, key: str = ACCOUNT_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={self.endpoint}/{ACCOUNT};")

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def bucket(self, name: str):
        """Microsoft's client of container `name`, made if missing."""
        from azure.storage.blob import BlobServiceClient

        container = BlobServiceClient.from_connection_string(self.connection_string()).get_container_client(name)
        if not container.exists():
            container.create_container()
        return container

    def upload(self, folder: Path, container: str, prefix: str) -> str:
        """Every file below `folder` as a blob under az://container/prefix/ (the container made if missing)."""
        target = self.bucket(container)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    target.upload_blob(f"{prefix}/{path.relative_to(folder).as_posix()}", f, overwrite=True)
        return f"az://{container}/{prefix}"

    def put(self, container: str, key: str, data: bytes) -> None:
        self.bucket(container).upload_blob(key, data, overwrite=True)

    def names(self, container: str, prefix: str) -> list[str]:
        """The blobs under az://container/prefix/ (committed: what a reader sees), by name below the prefix."""
        return sorted(b.name[len(prefix) + 1:] for b in self.bucket(container).list_blobs(f"{prefix}/"))

    def download(self, container: str, prefix: str, into: Path) -> list[str]:
        """Every blob under az://container/prefix/ into a folder; their names."""
        names = self.names(container, prefix)
        for name in names:
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(self.bucket(container).download_blob(f"{prefix}/{name}").readall())
        return names

    def unfinished(self, container: str, prefix: str) -> list[str]:
        """The blobs under the prefix that hold staged blocks no block list committed, once there are some (none
        after a minute)."""
        client = self.bucket(container)
        return _once_some(lambda: sorted({b.name for b in client.list_blobs(f"{prefix}/", include=["uncommittedblobs"])}
                                         - {b.name for b in client.list_blobs(f"{prefix}/")}))


def _create_only_where_none() -> None:
    """GCS answers an upload with `ifGenerationMatch=0` where the object exists with 412 (Precondition Failed), the
    conditional create a target's lock is; gcp-storage-emulator ignores the condition and overwrites. Its
    one-request (multipart) upload, which small objects such as the lock take, is made to check it as GCS does."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    upload = objects._multipart_upload
    if getattr(upload, "checks_generation", False):
        return

    def checked(request, response, storage):
        if request.query.get("ifGenerationMatch") == ["0"]:
            name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
            try:
                storage.get_file_obj(request.params["bucket_name"], name)
            except NotFound:
                pass
            else:
                response.status = HTTPStatus.PRECONDITION_FAILED
                return None
        return upload(request, response, storage)

    checked.checks_generation = True
    objects._multipart_upload = checked


@contextmanager
def gcs_emulator():
    import logging

    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)  # a line per request otherwise
    _create_only_where_none()
    server = create_server("127.0.0.1", free_port(), in_memory=True)
    server.start()
    host, port = server._api._httpd.server_address  # the server says its address nowhere else
    try:
        yield GcsEmulator(f"http://{host}:{port}")
    finally:
        server.stop()


def node_missing() -> str | None:
    """Why Azurite cannot run here, or None: node and npm are outside the project; `make test` installs the rest."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm, which install and run Azurite (the Azure Blob emulator), are not on this machine"
    return None


@contextmanager
def azurite():
    port = free_port()
    # blobs in memory: nothing on disk to remove; its debug log off (--silent)
    server = subprocess.Popen([str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                               "--skipApiVersionCheck", "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline and server.poll() is None, \
                f"Azurite did not start: {server.stderr.read().decode() if server.poll() is not None else ''}"
            time.sleep(0.1)
        yield Azurite(f"http://127.0.0.1:{port}")
    finally:
        server.kill()  # it holds everything in memory; on SIGTERM it waits for its clients' idle connections
        server.wait(timeout=30)
