"""A merge into a bucket prefix (s3://, gs://, az://): the bucket's lock taken first, the model merged into a local
staging folder as any merge is while every rank uploads the parts of the weight files as their blocks are written
(output/part_stream.py), then the rest uploaded and rank 0 completing the uploads (output/bucket_target.py)."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..engine.compare import CompareResult
from ..engine.dist import Group, on_every_rank, on_rank_zero
from ..errors import Interrupted, MergerError
from ..options import MergeOptions
from ..output.bucket_target import LAST, BucketTarget, folder_files, parts_of, shares, upload_share, uploaded_line
from ..output.part_stream import StreamedUpload

log = logging.getLogger("merger")

# The folder made when no --stage_dir is given holds the model as `MODEL`, its staging folder beside it.
MODEL = "model"


def merge_into_bucket(options: MergeOptions, group: Group,
                      stage_and_place: Callable[[MergeOptions, StreamedUpload, bool], CompareResult | None]
                      ) -> CompareResult | None:
    """Run `stage_and_place` into a local folder (--stage_dir, or a temporary one, which it is told it is: nothing
    is kept there to resume), streaming the weight files to options.target_dir from every rank as they are written,
    then upload the rest. Nothing is written in the bucket until the lock is taken there, and nothing there reads as
    a model until the upload is complete."""
    url = str(options.target_dir)
    if options.hf_upload_path:
        raise MergerError(f"--hf_upload_path publishes a local folder: merge to one, then `merger upload` it, {url}")
    hosts = group.all_gather(socket.gethostname())
    if options.stage_dir is None and len(set(hosts)) > 1:
        raise MergerError(f"ranks on {len(set(hosts))} hosts write the model before uploading it: give them a "
                          f"--stage_dir on a filesystem they all share, {url}")
    bucket: BucketTarget | None = None
    made: Path | None = None  # a temporary folder of this merge's, removed at the end

    def open_target() -> str:
        nonlocal bucket, made
        bucket = BucketTarget(url)
        bucket.open(options.overwrite, options.resume)
        if options.stage_dir is not None:
            return str(Path(options.stage_dir).absolute())
        made = Path(tempfile.mkdtemp(prefix="merger-upload-"))
        return str(made / MODEL)

    try:
        folder = Path(group.all_gather(on_every_rank(group, open_target if group.rank == 0 else lambda: "",
                                                     options.debug))[0])
        # The local folder of an earlier merge into this bucket holds no weights (sent and released): a resumed
        # merge replaces it, reusing what its staging folder still holds.
        local = dataclasses.replace(options, target_dir=folder, stage_dir=None, summary_json=None,
                                    overwrite=options.overwrite or options.resume)
        # --verify reads the staged files after the merge: they stay whole until the end.
        stream = StreamedUpload(url, bucket, release=not options.verify)
        verified = stage_and_place(local, stream, options.stage_dir is None)
        _upload(folder, url, group, bucket, stream, options.debug)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        if bucket is not None:
            bucket.abort()
        if made is None:  # the partial merge stays in --stage_dir, for --resume (the error line says so)
            raise
        raise Interrupted(str(e), f"nothing was written to {url} and nothing is kept (the uploads begun were "
                                  f"aborted, the temporary staging folder removed): give --stage_dir to keep a "
                                  f"partial merge that --resume continues") from e
    except BaseException:
        if bucket is not None:
            bucket.abort()
        raise
    finally:
        if bucket is not None:
            bucket.release()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    return verified


def _upload(folder: Path, url: str, group: Group, bucket: BucketTarget | None, stream: StreamedUpload,
            debug: bool) -> None:
    """After the merge: every rank sends its share of the parts of the files not streamed (those a resumed merge
    reused, tokenizer files...); rank 0 (the only one holding `bucket`) begins and completes every upload."""
    started = time.monotonic()
    files = group.all_gather(folder_files(folder) if group.rank == 0 else None)[0]  # one listing for all
    rest = parts_of({name: size for name, size in files.items() if name not in LAST and name not in stream.files})
    uploads = group.all_gather(on_every_rank(group, lambda: bucket.begin(rest) if bucket else None, debug))[0]
    mine = shares(rest, group.world)[group.rank]
    release = stream.weights if stream.release else frozenset()  # reused weight files go hollow as streamed ones
    etags: dict = dict(stream.etags)  # rank 0: the streamed parts'
    for share in group.all_gather(on_every_rank(group, lambda: upload_share(url, folder, mine, uploads, release),
                                                debug)):
        etags.update(share or {})
    parts = rest + parts_of(stream.files)
    on_rank_zero(group, lambda: bucket.complete(parts, etags, folder), debug)
    if group.rank == 0:
        log.info(uploaded_line(url, files, time.monotonic() - started, group.world))
