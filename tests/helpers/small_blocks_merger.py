"""`python -m merger` with checksum blocks of MERGER_TEST_CHECKSUM_BLOCK bytes instead of 256 MiB, so that a test
model's one file spans several, and, when MERGER_TEST_MOST_PER_BLOCK is set, that many CRC records per block and
rank at most instead of written_crcs.MOST_PER_BLOCK (0: every block is read back); each rank writes to
`$MERGER_TEST_HASHED.<rank>` how many bytes it read back to checksum them. Run in place of `-m merger`, as one
process or under torchrun; merger itself knows nothing of it.
"""
import os
import sys
from pathlib import Path

from merger.cli import main
from merger.output import resume, written_crcs

hashed = 0
crc32_range = resume.crc32_range


def counted_crc32_range(path, start, end, buf=None):
    global hashed
    hashed += end - start  # one checksum thread a rank: no race
    return crc32_range(path, start, end, buf)


if __name__ == "__main__":
    resume.CHECKSUM_BLOCK = int(os.environ["MERGER_TEST_CHECKSUM_BLOCK"])
    resume.crc32_range = counted_crc32_range
    if "MERGER_TEST_MOST_PER_BLOCK" in os.environ:
        written_crcs.MOST_PER_BLOCK = int(os.environ["MERGER_TEST_MOST_PER_BLOCK"])
    code = main()
    Path(f"{os.environ['MERGER_TEST_HASHED']}.{os.environ.get('RANK', '0')}").write_text(str(hashed))
    sys.exit(code)
