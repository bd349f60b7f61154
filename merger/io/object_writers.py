"""The writer of a target's store, by its URL's scheme (object_upload.py)."""
from __future__ import annotations

from .azure_upload import AzureWriter
from .gcs_upload import GcsWriter
from .object_upload import ObjectWriter
from .s3_upload import S3Writer

# one for each of locations.OBJECT_SCHEMES, the schemes a URL may have
WRITERS = {"s3": S3Writer, "gs": GcsWriter, "gcs": GcsWriter, "az": AzureWriter, "abfs": AzureWriter}


def object_writer(url: str) -> ObjectWriter:
    return WRITERS[url.split("://", 1)[0].lower()](url)
