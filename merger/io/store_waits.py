"""How merger's object-store clients wait and retry, stated here rather than left to the libraries' defaults: those
differ between libraries and versions, nest (s3fs retries what botocore already retried), and are untuned for a
merge. gcsfs's default is no timeout at all (a stalled read waits forever); azure-storage-blob's waits 60 s for a
silent answer and 18, 24 then 42 s between its tries.

Every store: a connection opens within CONNECT_TIMEOUT, and an answer that sends nothing for READ_TIMEOUT seconds
(MERGER_READ_TIMEOUT overrides it; MERGER_S3_READ_TIMEOUT, its older name, still does) counts as broken.

s3:// (s3fs over botocore), two layers, both bounded:
- botocore ("standard" mode) retries a request that got no usable answer: a 5xx or throttling answer (503
  SlowDown), a connection refused, reset or timed out before the response's headers. S3_ATTEMPTS tries, waiting
  a random 0 to 2**n seconds (at most 20) before try n+1. AWS_MAX_ATTEMPTS and AWS_RETRY_MODE, where set, replace
  this layer.
- s3fs sends the whole request again when botocore gave up, or when the response's body broke off after its
  headers (a reset, a stall, fewer bytes than its Content-Length): S3_REISSUES times, waiting 0.1 * 1.7**n s.

gs:// (gcsfs): GS_TRIES tries of a request on a 5xx, 408 or 429 answer, a connection error or a body that broke off,
waiting about 1, 2, 4, 8, 16 s (plus up to 1 s at random) between them: gcsfs's own count and waits, fixed in its
code (a decorator bound when gcsfs is imported), so stated here, not set.

az:// (adlfs over azure-storage-blob), two layers:
- the client's retry policy tries a request AZ_ATTEMPTS times on a 5xx (503 ServerBusy) or 408 answer or a
  connection error, waiting about 2, 4, 8 s (AZ_JITTER either way at random) between tries;
- a download whose body broke off after its headers is sent again, AZ_BODY_TRIES tries in all 1 s apart
  (azure-storage-blob's own, fixed in its code).

So one read that never succeeds ends after a bounded number of sends, each bounded by READ_TIMEOUT, and the merge
fails with one line naming the object.
"""
from __future__ import annotations

import os

from ..errors import UsageError

CONNECT_TIMEOUT = 10.0  # seconds to open a connection to the endpoint
READ_TIMEOUT = 20.0  # seconds a response may send nothing before the request counts as broken
S3_ATTEMPTS = 4  # botocore: tries of one request (the first included)
S3_REISSUES = 3  # s3fs: sends of a request whose answer broke off or that botocore gave up on
GS_TRIES = 6  # gcsfs: tries of one request, its own and not settable
AZ_ATTEMPTS = 4  # azure-storage-blob's retry policy: tries of one request (the first included)
AZ_BACKOFF_BASE = 2  # seconds: the wait before try n+1 is AZ_BACKOFF_BASE**n
AZ_JITTER = 1  # seconds either way, at random, of each wait
AZ_BODY_TRIES = 3  # azure-storage-blob: sends of a download whose body broke off, its own and not settable


def read_timeout() -> float:
    name = next((n for n in ("MERGER_READ_TIMEOUT", "MERGER_S3_READ_TIMEOUT") if n in os.environ), None)
    if name is None:
        return READ_TIMEOUT
    text = os.environ[name]
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError(f"{name} must be a number of seconds above 0, not {text!r}")
    return seconds


def store_filesystem(scheme: str):
    """A new fsspec client for `scheme` (of the environment as it is now: fsspec would reuse an older one) with
    these waits and retries. ImportError where its library is missing, ValueError for a scheme fsspec does not know."""
    import fsspec

    timeout = read_timeout()
    if scheme == "s3":
        config = {"connect_timeout": CONNECT_TIMEOUT, "read_timeout": timeout}
        if not ({"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & os.environ.keys()):
            config["retries"] = {"mode": "standard", "total_max_attempts": S3_ATTEMPTS}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config)
        fs.retries = S3_REISSUES  # a class attribute s3fs's constructor does not take
        return fs
    if scheme in ("gs", "gcs"):
        import aiohttp

        # gcsfs hands requests_timeout to each aiohttp request as it is: None (its default) is no limit at all
        return fsspec.filesystem(scheme, skip_instance_cache=True, requests_timeout=aiohttp.ClientTimeout(
            sock_connect=CONNECT_TIMEOUT, sock_read=timeout))
    fs = fsspec.filesystem(scheme, skip_instance_cache=True)
    if scheme in ("az", "abfs"):
        _tune_azure(fs.service_client, timeout)
    return fs


def _tune_azure(client, timeout: float) -> None:
    """adlfs builds its client with azure-storage-blob's default policy and transport and takes no retry setting;
    its timeout keywords reach blob reads and writes only, not listings or properties. So the one policy and the
    one transport that the client's container and blob clients share are set here, for every request."""
    policy = client._config.retry_policy
    policy.total_retries = AZ_ATTEMPTS - 1
    policy.initial_backoff, policy.increment_base = 0, AZ_BACKOFF_BASE
    policy.random_jitter_range = AZ_JITTER
    connection = client._config.transport.connection_config
    connection.timeout, connection.read_timeout = CONNECT_TIMEOUT, timeout
