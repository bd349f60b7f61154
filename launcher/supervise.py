"""Watch a group of running ranks until they end, with the launchers' common failure rules: the first failing
rank's exit status is the group's; ranks still running GRACE_S after a failure are terminated; a Ctrl-C at the
launcher reaches every rank as SIGINT. A rank is anything with subprocess.Popen's poll, returncode,
send_signal, terminate and wait: a local process, or one in a Ray actor seen through `launcher.ray`."""
from __future__ import annotations

import contextlib
import signal
import time

# After one rank fails, the others normally fail too at the merger's next sync point; a rank that hangs
# instead (its peer died without a word) is stopped after this many seconds.
GRACE_S = 30.0


def supervise(procs: list) -> int:
    """Wait for every rank; return the first non-zero exit status, else 0 (130 after a Ctrl-C)."""
    status, failed_at = 0, None
    try:
        while [p for p in procs if p.poll() is None]:  # polls every rank, so each returncode is fresh
            codes = [p.returncode for p in procs if p.returncode]
            if codes and failed_at is None:
                status, failed_at = codes[0], time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        status = 130
        _pass_on_ctrl_c(procs)
    finally:
        for p in procs:  # only those still running: after a failure's grace period, or on Ctrl-C
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    return status or next((p.returncode for p in procs if p.returncode), 0)


def _pass_on_ctrl_c(procs: list) -> None:
    """SIGINT to every rank still running, then up to GRACE_S for them to clean up and say so; a second Ctrl-C
    stops the wait (the ranks still running are then terminated)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + GRACE_S
    with contextlib.suppress(KeyboardInterrupt):
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
