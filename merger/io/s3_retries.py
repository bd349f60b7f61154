"""How merger's S3 client waits and retries, stated here rather than left to the libraries' defaults (which differ
between s3fs, botocore and their versions, and nest: s3fs retries what botocore already retried).

Two layers, both bounded:
- botocore ("standard" mode) retries a request that got no usable answer: a 5xx or throttling answer (503
  SlowDown), a connection refused, reset or timed out before the response's headers. ATTEMPTS tries, waiting
  a random 0 to 2**n seconds (at most 20) before try n+1.
- s3fs sends the whole request again when botocore gave up, or when the response's body broke off after its
  headers (a reset, a stall, fewer bytes than its Content-Length): REISSUES times, waiting 0.1 * 1.7**n s.

A response that sends nothing for READ_TIMEOUT seconds (MERGER_S3_READ_TIMEOUT overrides it) counts as broken. So
one request that never succeeds ends within ATTEMPTS * REISSUES tries; if each stalls, within about
ATTEMPTS * REISSUES * (READ_TIMEOUT + 20 s); if each is refused (503), within about 2 minutes. Then the merge
fails with one line naming the object. AWS_MAX_ATTEMPTS and AWS_RETRY_MODE, where set, replace botocore's layer.
"""
from __future__ import annotations

import os

from ..errors import UsageError

CONNECT_TIMEOUT = 10.0  # seconds to open a connection to the endpoint
READ_TIMEOUT = 20.0  # seconds a response may send nothing before the request counts as broken
ATTEMPTS = 4  # botocore: tries of one request (the first included)
REISSUES = 3  # s3fs: sends of a request whose answer broke off or that botocore gave up on


def read_timeout() -> float:
    text = os.environ.get("MERGER_S3_READ_TIMEOUT")
    if text is None:
        return READ_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError(f"MERGER_S3_READ_TIMEOUT must be a number of seconds above 0, not {text!r}")
    return seconds


def s3_filesystem():
    """A new s3fs client (of the environment as it is now) with these waits and retries."""
    import fsspec

    config = {"connect_timeout": CONNECT_TIMEOUT, "read_timeout": read_timeout()}
    if not ({"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & os.environ.keys()):
        config["retries"] = {"mode": "standard", "total_max_attempts": ATTEMPTS}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config)
    fs.retries = REISSUES  # a class attribute s3fs's constructor does not take
    return fs
