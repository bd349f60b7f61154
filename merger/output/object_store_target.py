"""A bucket prefix (s3://, gs://, az://) as a merge's target (the `Target` protocol, output/target.py): the bucket's
lock taken first, the model merged into a local folder through a LocalTarget while every rank uploads the parts of
the weight files as their blocks are written (part_stream.py), then the rest uploaded and rank 0 completing the
uploads (bucket_target.py). Nothing is written in the bucket until the lock is taken there, and nothing there reads
as a model until the upload is complete."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path

from ..engine.dist import Group, on_every_rank, on_rank_zero
from ..engine.peer_watch import Cleanup
from ..engine.prepared import Prepared
from ..errors import Interrupted, MergerError
from ..options import MergeOptions
from .bucket_target import LAST, BucketTarget, folder_files, parts_of, shares, upload_share, uploaded_line
from .local_target import LocalTarget
from .part_stream import StreamedUpload

log = logging.getLogger("merger")

# The folder made when no --stage_dir is given holds the model as `MODEL`, its staging folder beside it.
MODEL = "model"


class ObjectStoreTarget:
    """One merge into a bucket prefix: rank 0's side of the bucket (its lock, the uploads it begins and completes),
    and the local target the model is merged into first (--stage_dir, or a temporary folder: nothing is kept there
    to resume)."""

    def __init__(self, options: MergeOptions, group: Group, prepared: Prepared):
        self.options, self.group, self.prepared = options, group, prepared
        self.url = str(options.target_dir)
        self.bucket: BucketTarget | None = None  # rank 0's, from before its lock is taken
        self.made: Path | None = None  # rank 0: a temporary folder of this merge's, removed at the end
        self.folder: Path | None = None  # every rank's, once open() agreed on it: where the model is merged first
        self.stream: StreamedUpload | None = None
        self.local: LocalTarget | None = None
        self.cleanup = Cleanup(self._discard)  # what the peer watch runs when a rank is lost

    @property
    def where(self) -> str:
        return self.url

    @property
    def written(self) -> Path:
        return self.local.written

    def open(self) -> bool:
        """Rank 0 checks the prefix and takes its lock; then the local target opens, its weight files to be sent as
        they are written."""
        options, group = self.options, self.group
        if options.hf_upload_path:
            raise MergerError(f"--hf_upload_path publishes a local folder: merge to one, then `merger upload` it, "
                              f"{self.url}")
        hosts = group.hosts
        if options.stage_dir is None and len(set(hosts)) > 1:
            raise MergerError(f"ranks on {len(set(hosts))} hosts write the model before uploading it: give them a "
                              f"--stage_dir on a filesystem they all share, {self.url}")
        opened = on_every_rank(group, self._open if group.rank == 0 else lambda: "", options.debug)
        self.folder = Path(group.all_gather(opened)[0])
        # The local folder of an earlier merge into this bucket holds no weights (sent and released): a resumed
        # merge replaces it, reusing what its staging folder still holds.
        local = dataclasses.replace(options, target_dir=self.folder, stage_dir=None, summary_json=None,
                                    overwrite=options.overwrite or options.resume)
        # --verify reads the staged files after the merge: they stay whole until the end.
        self.stream = StreamedUpload(self.url, self.bucket, release=not options.verify)
        self.local = LocalTarget(local, group, self.prepared, self.stream, temporary=options.stage_dir is None)
        return self.local.open()

    def _open(self) -> str:
        """Rank 0: the bucket's lock taken, and the local folder the model is merged into."""
        self.bucket = BucketTarget(self.url)
        self.bucket.open(self.options.overwrite, self.options.resume)
        if self.options.stage_dir is not None:
            return str(Path(self.options.stage_dir).absolute())
        self.made = Path(tempfile.mkdtemp(prefix="merger-upload-"))
        return str(self.made / MODEL)

    def prepare(self) -> None:
        self.local.prepare()

    def write(self, reader) -> None:
        self.local.write(reader)

    def finish(self) -> None:
        self.local.finish()

    def commit(self) -> None:
        """The local folder complete, then every rank's share of what was not streamed sent, and rank 0 completing
        the uploads, the model's entry points last."""
        self.local.commit()
        self._upload()

    def _upload(self) -> None:
        """Every rank sends its share of the parts of the files not streamed (those a resumed merge reused, tokenizer
        files...); rank 0 (the only one holding `bucket`) begins and completes every upload."""
        group, folder, bucket, stream, debug = self.group, self.folder, self.bucket, self.stream, self.options.debug
        started = time.monotonic()
        files = group.all_gather(folder_files(folder) if group.rank == 0 else None)[0]  # one listing for all
        rest = parts_of({name: size for name, size in files.items() if name not in LAST and name not in stream.files})
        uploads = group.all_gather(on_every_rank(group, lambda: bucket.begin(rest) if bucket else None, debug))[0]
        mine = shares(rest, group.world)[group.rank]
        release = stream.weights if stream.release else frozenset()  # reused weight files go hollow as streamed ones
        etags: dict = dict(stream.etags)  # rank 0: the streamed parts'
        for share in group.all_gather(on_every_rank(
                group, lambda: upload_share(self.url, folder, mine, uploads, release), debug)):
            etags.update(share or {})
        parts = rest + parts_of(stream.files)
        on_rank_zero(group, lambda: bucket.complete(parts, etags, folder), debug)
        if group.rank == 0:
            log.info(uploaded_line(self.url, files, time.monotonic() - started, group.world))

    def fail(self, e: BaseException) -> None:
        """The local target's failure path (which keeps a partial merge in --stage_dir for --resume), then the
        uploads begun aborted and the lock released. Ctrl-C with no --stage_dir leaves nothing anywhere: say so."""
        try:
            if self.local is not None:
                self.local.fail(e)
        finally:
            if self.bucket is not None:
                self.bucket.abort()
        if isinstance(e, KeyboardInterrupt) and self.made is not None:
            raise Interrupted(str(e), f"nothing was written to {self.url} and nothing is kept (the uploads begun "
                                      f"were aborted, the temporary staging folder removed): give --stage_dir to "
                                      f"keep a partial merge that --resume continues") from e

    def _discard(self) -> None:
        """A lost rank: the peer watch of the lowest surviving rank runs this before its process ends, with no
        failure path after it. The local target's cleanup; on rank 0 (the only one holding `bucket`) the uploads begun
        aborted and the lock released, so the bucket holds nothing of this merge; the temporary folder removed."""
        local = self.local
        if local is not None and local.cleanup is not None:
            local.cleanup()
        if self.bucket is not None:
            self.bucket.abort()
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)

    def release(self) -> None:
        if self.local is not None:
            self.local.release()
        if self.bucket is not None:
            self.bucket.release()
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
        self.cleanup = None
