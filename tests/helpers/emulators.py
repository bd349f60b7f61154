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

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Every file below `folder` as an object under gs://bucket/prefix/ (the bucket made if missing); its URL."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="merger-test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.endpoint})
        target = client.lookup_bucket(bucket) or client.create_bucket(bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                target.blob(f"{prefix}/{path.relative_to(folder).as_posix()}").upload_from_filename(str(path))
        return f"gs://{bucket}/{prefix}"


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

    def upload(self, folder: Path, container: str, prefix: str) -> str:
        """Every file below `folder` as a blob under az://container/prefix/ (the container made if missing)."""
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(self.connection_string())
        target = service.get_container_client(container)
        if not target.exists():
            target.create_container()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    target.upload_blob(f"{prefix}/{path.relative_to(folder).as_posix()}", f, overwrite=True)
        return f"az://{container}/{prefix}"


@contextmanager
def gcs_emulator():
    import logging

    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)  # a line per request otherwise
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
