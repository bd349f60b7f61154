"""The error record torchrun reads when a worker fails, so that its report names merger's error line.

torchrun gives every worker a path in TORCHELASTIC_ERROR_FILE. When workers fail, its agent reads the file
of the first one to fail and prints the message in it as the root cause; a worker that wrote none shows as
`error_file: <N/A>` with a pointer to torch's docs. The JSON is what torch.distributed.elastic's own
ErrorHandler writes: {"message": {"message": ..., "extraInfo": {"timestamp": "<seconds>"}}}; the agent
shows extraInfo.py_callstack when present, else the message, so merger's one line is all it prints.
"""
from __future__ import annotations

import json
import os
import time


def record_for_torchrun(line: str) -> None:
    """Write `line` as this worker's error record, when running under torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The agent parses the timestamp with int() and takes the smallest as the root cause: whole seconds.
    record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the line is on stderr already; without the record torchrun's report is only vaguer
