"""Family files read alone (merger/mapping/family_file.py; docs/families.md): a malformed file is one line naming the
file and the bad entry, with the message a built-in record's same mistake gets; the TOML and JSON forms of one family
are one record; `merger families` lists the records, or a file's rows. What a file does to a merge is
tests/test_family_file.py's, on a checkpoint megatron-core wrote.

Oracles: the row checks' own refusals of the same rows built in Python (tests/unit/test_family_records.py shows them
as records get them), the docs' example file, and Python's json of it for the JSON form.
"""
from __future__ import annotations

import json
import sys

import pytest

from merger.errors import MergerError
from merger.mapping.families import FAMILIES
from merger.mapping.family import Row
from merger.mapping.family_file import read_family
from tests.helpers.in_process import command_here, stdout_in_process
from tests.helpers.paths import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

pytestmark = pytest.mark.unit

EXAMPLE = ROOT / "docs" / "families" / "qwen2.toml"
ROW = 'source = "mlp.linear_fc2.weight"\nkind = "rename"\ntargets = ["mlp.down_proj.weight"]'


def _refusal(tmp_path, text: str, suffix: str = ".toml") -> str:
    path = tmp_path / f"family{suffix}"
    path.write_text(text)
    with pytest.raises(MergerError) as refused:
        read_family(path)
    message = str(refused.value)
    assert "\n" not in message and message.endswith(f", {path}"), message
    return message


def _row_error(*args) -> str:
    with pytest.raises(ValueError) as refused:
        Row(*args)
    return str(refused.value)


@pytest.mark.parametrize("edit, args", [
    (("kind = \"rename\"\ntargets = [\"mlp.down_proj.weight\"]", "kind = \"gate_upp\"\ntargets = []"),
     ("mlp.linear_fc2.weight", "gate_upp")),
    (("targets = [\"mlp.down_proj.weight\"]", "targets = [\"mlp.down_proj.weight\", \"mlp.up_proj.weight\"]"),
     ("mlp.linear_fc2.weight", "rename", ("mlp.down_proj.weight", "mlp.up_proj.weight"))),
], ids=["an unknown kind", "a rename with two targets"])
def test_a_bad_row_is_refused_as_a_built_in_one_is_naming_its_entry(edit, args, tmp_path):
    text = EXAMPLE.read_text()
    message = _refusal(tmp_path, text.replace(*edit))
    assert message.startswith(f"megatron[8]: {_row_error(*args)}"), message  # the file's ninth row


@pytest.mark.parametrize("text, expected", [
    ('name = "x"\nmodel_types = ["qwen2"]\n', "the family file has no megatron"),
    (f'name = "x"\nmodel_types = "qwen2"\n[[megatron]]\n{ROW}\n', "model_types is a str, not a list"),
    (f'name = "x"\nmodel_types = ["qwen2"]\n[[megatron]]\n{ROW}\ntarget = "y"\n', "megatron[0] has the unknown key "
                                                                                  "'target' (known: source, kind"),
    (f'name = "x"\nmodel_types = ["qwen2"]\nmtp = 1\n[[megatron]]\n{ROW}\n', "the family file has the unknown key "
                                                                             "'mtp'"),
    ('name = "x"\nmodel_types = ["qwen2"]\n[[megatron]]\nsource = "mlp.linear_fc2.weight"\n',
     "megatron[0] has no kind"),
    (f'name = "x"\nmodel_types = ["qwen2"\n[[megatron]]\n{ROW}\n', "the family file is not valid TOML: "),
    # a source whose TP split merger does not know, as families.py refuses a record's
    (f'name = "x"\nmodel_types = ["qwen2"]\n[[megatron]]\n{ROW.replace("fc2.weight", "fc2.weigth")}\n',
     "row 'mlp.linear_fc2.weigth' of the x family: sources/megatron_tp.py does not say how TP splits it"),
    (f'name = "x"\nmodel_types = ["qwen2"]\n[[megatron]]\n{ROW}\n[[megatron]]\n{ROW}\n',
     "row 'mlp.linear_fc2.weight' appears twice in the x family's Megatron rows"),
    # a VLM around a built-in family's text model: which family maps it would depend on the file
    (f'name = "x"\nmodel_types = ["kimi_k25"]\n[[megatron]]\n{ROW}\n',
     "model type 'kimi_k25' is the HF VLM around the deepseek_v3 family's text model"),
], ids=["no rows", "a string for a list", "an unknown row key", "an unknown key", "a row without a kind", "bad TOML",
        "a TP split unknown", "a source twice", "a VLM's model type"])
def test_a_malformed_file_is_one_line_naming_the_file_and_the_entry(text, expected, tmp_path):
    assert expected in _refusal(tmp_path, text)


def test_a_file_neither_toml_nor_json_is_refused(tmp_path):
    assert "a family file is TOML (.toml) or JSON (.json), not .yaml" in _refusal(tmp_path, "name: x", ".yaml")
    assert "the family file is not valid JSON: " in _refusal(tmp_path, "{", ".json")


def test_the_json_form_of_the_docs_example_is_the_same_family(tmp_path):
    as_json = tmp_path / "qwen2.json"
    as_json.write_text(json.dumps(tomllib.loads(EXAMPLE.read_text())))
    toml_family, json_family = read_family(EXAMPLE), read_family(as_json)
    assert (toml_family.name, toml_family.model_types, toml_family.megatron) == \
           (json_family.name, json_family.model_types, json_family.megatron) == \
           ("qwen2-from-a-file", ("qwen2",), next(f for f in FAMILIES if f.name == "qwen2").megatron)


def test_merger_families_lists_each_record_and_the_frameworks_it_is_mapped_from(capsys):
    shown = {line.split()[0]: line.split(None, 1)[1] for line in stdout_in_process(capsys, "families").splitlines()[1:]}
    assert set(shown) == {f.name for f in FAMILIES}
    for family in FAMILIES:
        types, mapped_from = shown[family.name].split("  ", 1)
        assert types == ", ".join(family.model_types)
        frameworks = mapped_from.strip().split(", ")
        # a family written only inside its VLM maps Megatron's VLM checkpoints, not its text model alone
        assert ("Megatron" in frameworks, "torchtitan" in frameworks) == (
            bool(family.megatron) and not family.vlm_only, bool(family.torchtitan)), mapped_from
        if family.megatron_vision:
            assert f"Megatron's VLM as {' or '.join(family.megatron_vision.model_types)}" in frameworks


def test_merger_families_shows_a_files_rows_or_one_line_for_a_bad_file(capsys, tmp_path):
    shown = stdout_in_process(capsys, "families", "--family", EXAMPLE).splitlines()
    assert "replaces the built-in qwen2 family" in shown[0]
    assert shown[3].split() == ["self_attention.linear_qkv.weight", "qkv", "self_attn.q_proj.weight,",
                                "self_attn.k_proj.weight,", "self_attn.v_proj.weight"]
    assert len(shown) == 1 + len(tomllib.loads(EXAMPLE.read_text())["megatron"])
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    assert command_here(capsys, "families", "--family", bad) == (
        1, [f"merger: error: the family file has no model_types, no megatron (docs/families.md shows one), {bad}"])
