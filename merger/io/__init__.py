"""Where checkpoints are read from: local files, or objects in a bucket (s3://, gs://, az://), behind one protocol.

Sources walk a checkpoint through a `Location` (local folders are `pathlib.Path`s, objects `ObjectPath`s, both
answering the same questions: listing, is_file, small whole reads) and read tensor bytes through the `Storage`
that holds a file (`storage_of`), into the caller's buffer at the offsets the plan gives.
"""
from __future__ import annotations

from .files import exists, file_identity, file_size, is_file, read_range, read_whole
from .locations import fetched_bytes, is_remote, location, reads_objects, relative_name, storage_of
from .storage import Storage

__all__ = ["Storage", "exists", "file_identity", "file_size", "is_file", "fetched_bytes", "is_remote", "location", "read_range",
           "read_whole", "reads_objects", "relative_name", "storage_of"]
