"""The first transformers release that knows each model type merger writes from its own family records.

A Megatron or torchtitan checkpoint is written under the names merger's records give, so the merge itself needs
no model class from transformers; loading the merged folder does. Where the installed transformers predates the
model type, the merge stops before anything is written, with one line naming the release to install. Read from
transformers' auto config mappings in the PyPI wheels, release by release; types that transformers 4.50 (merger's
own floor, pyproject.toml) already knows are not listed. kimi_k2 is absent: it is remote code, in no release.
"""
from __future__ import annotations

import re
from importlib.metadata import version

from ..errors import MergerError

FIRST_RELEASE = {
    "qwen3": "4.51.0", "qwen3_moe": "4.51.0", "deepseek_v3": "4.51.0", "glm4_moe": "4.54.0", "ernie4_5_moe": "4.54.0", "gpt_oss": "4.55.0", "qwen3_next": "4.57.0", "minimax_m2": "5.0.0",
    "glm_moe_dsa": "5.2.0", "qwen3_5": "5.2.0", "qwen3_5_moe": "5.2.0", "qwen3_5_text": "5.2.0",
    "qwen3_5_moe_text": "5.2.0", "nemotron_h": "5.3.0", "hy_v3": "5.6.0", "deepseek_v32": "5.11.0", "kimi_k25": "5.13.0",
    "mimo_v2_flash": "5.13.0", "qwen3_vl": "4.57.0", "qwen3_vl_moe": "4.57.0", "qwen3_vl_moe_text": "4.57.0",
    "glm4v_moe": "4.56.0",
}


def _release(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; a dev or rc suffix counts as its release."""
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text).groups(default="0"))


def require_model_type(model_type: str | None, where: object) -> None:
    """One line when the installed transformers has no `model_type` yet (config.json at `where`)."""
    needed = FIRST_RELEASE.get(model_type)
    installed = version("transformers")
    if needed and _release(installed) < _release(needed):
        raise MergerError(f"transformers {installed} has no model type {model_type!r}, which came in transformers "
                          f"{needed}: pip install 'transformers>={needed}' to merge it, {where}")
