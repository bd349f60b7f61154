"""The transformers release each model type needs (merger/mapping/transformers_release.py).

Oracle: the installed transformers' own auto config mapping, which must know every listed type (this transformers
is newer than each release listed), and the family records, whose types transformers 4.50 lacked must be listed.
"""
from __future__ import annotations

import pytest

from merger.errors import MergerError
from merger.mapping import transformers_release
from merger.mapping.families import FAMILIES
from merger.mapping.transformers_release import FIRST_RELEASE, require_model_type

pytestmark = pytest.mark.unit

# model types transformers 4.50 (merger's floor) already had, the rest of the records' types listed or remote code
IN_4_50 = {"llama", "mistral", "qwen2", "qwen2_moe", "mixtral", "olmoe"}
REMOTE_CODE = {"kimi_k2"}


def test_every_listed_type_is_one_the_installed_transformers_knows():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert set(FIRST_RELEASE) <= set(CONFIG_MAPPING_NAMES)


def test_every_family_type_is_listed_old_enough_or_remote_code():
    types = {t for f in FAMILIES for t in f.model_types + f.vlm_types()}
    assert types - IN_4_50 - REMOTE_CODE <= set(FIRST_RELEASE), types - IN_4_50 - REMOTE_CODE - set(FIRST_RELEASE)


def test_an_older_transformers_stops_with_the_release_to_install(monkeypatch):
    monkeypatch.setattr(transformers_release, "version", lambda name: "4.56.2")
    with pytest.raises(MergerError, match=r"^transformers 4.56.2 has no model type 'qwen3_next', which came in "
                                          r"transformers 4.57.0: pip install 'transformers>=4.57.0' to merge it, "
                                          r"ckpt/config.json$"):
        require_model_type("qwen3_next", "ckpt/config.json")
    require_model_type("gpt_oss", "ckpt/config.json")  # 4.55.0: known by 4.56.2
    require_model_type("llama", "ckpt/config.json")
    monkeypatch.setattr(transformers_release, "version", lambda name: "5.11.0.dev0")
    require_model_type("deepseek_v32", "ckpt/config.json")
