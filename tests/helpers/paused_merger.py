"""`python -m merger`, paused after a given batch: tests stop a real merge at a known point with it.

Run in place of `-m merger` (conftest does so when the environment asks for a pause), as one process or under
torchrun: with MERGER_TEST_PAUSE_AFTER_BATCH=N and MERGER_TEST_PAUSE_FILE=P, once batches 0..N are written on
every rank (and each rank has checksummed the blocks of its share they completed), each rank writes its pid
to `P.<rank>` and sleeps, for the test to kill, stop or signal it, or to remove `P.<rank>`, which lets it go on.
MERGER_TEST_PAUSE_RANK=r pauses only rank r: the others go on into the next collective and wait there for it. The
pause wraps `FileTracker.confirmed`, where a rank learns at a sync point that every rank wrote the batches so far;
merger itself knows nothing of it.
"""
import os
import sys
import time
from pathlib import Path

from merger.output import resume
from merger.cli import main


def _pause_after(batch: int, file: str, only: int | None):
    confirmed = resume.FileTracker.confirmed

    def confirmed_then_pause(self, count: int) -> None:
        confirmed(self, count)
        if count == batch + 1 and only in (None, self.group.rank):
            for future in self.futures:  # this rank's checksums of the blocks finished so far
                future.result()
            paused = Path(f"{file}.{self.group.rank}")
            paused.write_text(str(os.getpid()))
            # Short sleeps: a signal that lands after the file is written but before a long sleep starts would
            # only be acted on when that sleep ends; between short ones Python runs its handler at once.
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline and paused.exists():
                time.sleep(0.05)

    return confirmed_then_pause


def pause_as_the_environment_says() -> None:
    """Make every merge this process (or a process forked from it) runs pause as MERGER_TEST_PAUSE_* say."""
    only = os.environ.get("MERGER_TEST_PAUSE_RANK")
    resume.FileTracker.confirmed = _pause_after(int(os.environ["MERGER_TEST_PAUSE_AFTER_BATCH"]),
                                                os.environ["MERGER_TEST_PAUSE_FILE"],
                                                int(only) if only is not None else None)


if __name__ == "__main__":
    pause_as_the_environment_says()
    sys.exit(main())
