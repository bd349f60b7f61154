"""A stand-in for the Hugging Face Hub API in tests (there is no network here).

`RecordingHfApi` has the HfApi methods merger calls, checks each call's arguments against the real method's
signature, and appends each call, with the calling process's RANK, as one JSON line to a log file.
In-process tests patch it in directly. Run as a script (`torchrun tests/helpers/hub_recorder.py merge ...`, with
MERGER_TEST_HUB_LOG set), it puts the recorder in place of huggingface_hub.HfApi and then runs merger's own
main(), so every rank uploads through it. No interpreter start-up hook is used (a `sitecustomize` on
PYTHONPATH loses to the one some interpreters ship, e.g. Debian's).
"""
import inspect
import json
import os
import sys


class RecordingHfApi:
    def __init__(self, log: str | None = None):
        self.log = log or os.environ["MERGER_TEST_HUB_LOG"]

    def _record(self, method: str, kwargs: dict) -> None:
        from huggingface_hub.hf_api import HfApi  # the real class: every call must fit its signature

        inspect.signature(getattr(HfApi, method)).bind(None, **kwargs)
        with open(self.log, "a") as f:
            f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "method": method, "kwargs": kwargs},
                               default=str) + "\n")

    def create_repo(self, **kwargs):
        self._record("create_repo", kwargs)
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def upload_folder(self, **kwargs):
        self._record("upload_folder", kwargs)

    def upload_large_folder(self, **kwargs):
        self._record("upload_large_folder", kwargs)


def calls(log) -> list[dict]:
    """The recorded calls, in order."""
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


if __name__ == "__main__":
    import huggingface_hub

    huggingface_hub.HfApi = RecordingHfApi  # before merger imports it
    from merger.cli import main

    sys.exit(main())
