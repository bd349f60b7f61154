"""`python -m merger` with checksum blocks of MERGER_TEST_CHECKSUM_BLOCK bytes instead of 256 MiB, so that a test
model's one file spans several, and, when MERGER_TEST_MOST_PER_BLOCK is set, that many CRC records per block and
rank at most instead of written_crcs.MOST_PER_BLOCK (0: every block is read back); when MERGER_TEST_HASHED is set,
each rank writes to `$MERGER_TEST_HASHED.<rank>` how many bytes it read back to checksum them. With
MERGER_TEST_SLOW_DIRECT_WRITES=S, each direct write (output/direct_writes.py) sleeps S seconds on its thread before
it writes: a slow disk, behind which the writes handed over queue up. Run in place of `-m merger`, as one process
or under torchrun; merger itself knows nothing of it.
"""
import os
import sys
import time
from pathlib import Path

from merger.cli import main
from merger.output import direct_writes, resume, written_crcs

hashed = 0
crc32_range = resume.crc32_range


def counted_crc32_range(path, start, end, buf=None):
    global hashed
    hashed += end - start  # one checksum thread a rank: no race
    return crc32_range(path, start, end, buf)


def slow_disk(seconds: float):
    pwrite_all = direct_writes._pwrite_all

    def slow_pwrite_all(fd, path, data, at):
        time.sleep(seconds)
        pwrite_all(fd, path, data, at)

    return slow_pwrite_all


if __name__ == "__main__":
    resume.CHECKSUM_BLOCK = int(os.environ["MERGER_TEST_CHECKSUM_BLOCK"])
    resume.crc32_range = counted_crc32_range
    if "MERGER_TEST_MOST_PER_BLOCK" in os.environ:
        written_crcs.MOST_PER_BLOCK = int(os.environ["MERGER_TEST_MOST_PER_BLOCK"])
    if "MERGER_TEST_SLOW_DIRECT_WRITES" in os.environ:
        direct_writes._pwrite_all = slow_disk(float(os.environ["MERGER_TEST_SLOW_DIRECT_WRITES"]))
    code = main()
    if "MERGER_TEST_HASHED" in os.environ:
        Path(f"{os.environ['MERGER_TEST_HASHED']}.{os.environ.get('RANK', '0')}").write_text(str(hashed))
    sys.exit(code)
