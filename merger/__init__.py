"""merger: turn distributed training checkpoints into standalone HuggingFace models, streaming.

As a library: `merger.merge(local_dir=..., target_dir=..., **options)`, `merger.inspect(...)`,
`merger.verify(...)` (merger/api), raising `merger.MergerError` for bad input: a subclass of it per kind of failure
(merger.SourceError, merger.TargetBusyError, ...; docs/api.md). They are loaded on first use, so
`import merger` stays light (torch is imported only by a call).
"""
from .errors import (CorruptSourceError, CredentialsError, Interrupted, MergerError, SourceError,
                     StoreUnavailableError, TargetBusyError, TargetError, UsageError)
from .version import __version__

_API = ("merge", "inspect", "verify")
__all__ = ["CorruptSourceError", "CredentialsError", "Interrupted", "MergerError", "SourceError",
           "StoreUnavailableError", "TargetBusyError", "TargetError", "UsageError", "__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'merger' has no attribute {name!r}")
