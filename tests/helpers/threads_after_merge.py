"""Runs `merger ARGS` in this process, then prints the threads still running in it, as the kernel lists them.

A merge must leave no thread behind when it returns: one still running then runs on into interpreter
finalization, where gloo's worker threads free their last collectives' tensors, take the GIL and abort the
process (SIGABRT, "terminate called without an active exception") after a merge that succeeded.
"""
from __future__ import annotations

import json
import os
import sys

from merger.cli import main


def threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


if __name__ == "__main__":
    before = threads()
    status = main(sys.argv[1:])
    report = {"rank": int(os.environ.get("RANK", "0")), "status": status, "before": before, "after": threads()}
    sys.stdout.flush()
    os.write(1, (json.dumps(report) + "\n").encode())  # one write: the ranks share torchrun's stdout
    sys.exit(status)
