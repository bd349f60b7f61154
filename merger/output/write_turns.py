"""Ranks of one host take turns writing into an output file, sleeping rather than spinning while they wait.

Linux filesystems hold a file's inode lock for the whole of a buffered write, so ranks of one host that write
into the same file (every rank writes its rows of every tensor when pieces are placed directly) already write
one at a time. The kernel makes the waiting rank spin on that lock while the writer runs: measured here, two
processes writing 1 GiB each into the two halves of one file took the same wall time as one writing both, and
twice its system CPU. A rank that spins holds a core its own reading, casting and hashing could use; an flock
taken around each write makes it sleep instead (the same two writers: same wall time, half the system CPU).
2-rank merges of the 4.13 GiB benchmark checkpoint took 5.5-9.4 s with turns against 6.8-13.3 s without in an
hour when this VM filled new page-cache pages slowly, and the same with or without when it filled them fast.

The turns are taken with flock on the output file itself, so only where flock is local to the host: on the
filesystems named below. On NFS, Lustre or GPFS an flock may be a round trip to a server, once per write.
"""
from __future__ import annotations

import fcntl
import os
import re
from contextlib import contextmanager
from pathlib import Path

# mountinfo writes a space, tab, newline or backslash in a path as an octal escape (\040 ...); other bytes as is
_OCTAL = re.compile(r"\\([0-7]{3})")

HOST_LOCAL = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "overlay"})


def filesystem_type(path: Path, mountinfo: str) -> str | None:
    """The type of the filesystem that holds `path` (an absolute, resolved path), given the text of
    /proc/self/mountinfo: that of the deepest mount point above it, the last mounted where several are."""
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        mount = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = mount == "/" or path == Path(mount) or Path(mount) in path.parents
        if inside and len(mount) >= best:
            best, kind = len(mount), fields[fields.index("-", 6) + 1]
    return kind


def host_local(folder: Path) -> bool:
    """Whether `folder` lies on a filesystem of this host (HOST_LOCAL), where flock stays on the host and a direct
    write goes to a local disk (direct_writes.py)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:  # not Linux, or no /proc: nothing is known of it
        return False
    return filesystem_type(folder.resolve(), mountinfo) in HOST_LOCAL


def should_take_turns(folder_is_host_local: bool, ranks_on_host: int) -> bool:
    """Whether the ranks writing into a folder should take turns: more than one of them on this host, and a
    filesystem where flock stays on the host (host_local)."""
    return ranks_on_host > 1 and folder_is_host_local


@contextmanager
def turn(fd: int, take_turn: bool):
    """This host's turn at the file `fd` (an flock on it) for the writes inside, when `take_turn`."""
    if not take_turn:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def write_at(fd: int, data: memoryview, at: int, take_turn: bool) -> int:
    """One pwrite of `data` at offset `at`, in this host's turn when `take_turn`; the bytes written."""
    with turn(fd, take_turn):
        return os.pwrite(fd, data, at)


def copy_at(fd: int, source: int, source_at: int, at: int, size: int, take_turn: bool) -> int:
    """One copy_file_range of `size` bytes from byte `source_at` of the file `source` to offset `at`, in this
    host's turn when `take_turn`; the bytes copied (0: the source ends at `source_at`)."""
    with turn(fd, take_turn):
        return os.copy_file_range(source, fd, size, source_at, at)
