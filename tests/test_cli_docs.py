"""The command line against its documentation: README's `merge` options table and the parser agree, every option
has help text, and a misspelled flag or backend fails at parse time with a hint."""
from __future__ import annotations

import argparse
import re

import pytest

from conftest import ROOT
from merger.cli import build_parser, main

REQUIRED = ["--local_dir", "ckpt", "--target_dir", "out"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option by its first spelling (verl's, with underscores), help left out."""
    return {a.option_strings[0]: a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _readme_rows() -> list[tuple[list[str], list[str], str]]:
    """(flags, default of each flag, whole row) for every row of README's `merge` options table."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### `merge` options"):].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        flags_cell, default_cell, _ = (c.strip() for c in line.strip("|").split("|"))
        flags = [f.split()[0] for f in re.findall(r"`([^`]+)`", flags_cell)]
        defaults = [d.strip() for d in default_cell.split(",")]
        rows.append((flags, defaults, line))
    return rows


def _parsed(*args: str):
    return build_parser().parse_args(["merge", *REQUIRED, *args])


def test_readme_options_table_matches_the_merge_parser():
    """Every flag in the table exists with the documented default, every choice is named in its row, and every
    merge option has a row."""
    options = _options(_subparsers(build_parser())["merge"])
    documented = set()
    for flags, defaults, line in _readme_rows():
        assert len(flags) == len(defaults), f"one default per flag: {line}"
        for flag, default in zip(flags, defaults):
            assert flag in options, f"README documents {flag}, which merge does not take"
            action = options[flag]
            documented.add(flag)
            if default == "required":
                assert action.required, flag
            elif default == "off":
                assert action.nargs == 0 and action.default is False, flag
            elif re.fullmatch(r"`[^`]+`", default):  # a literal: as if given on the command line
                assert getattr(_parsed(), action.dest) == getattr(_parsed(flag, default.strip("`")), action.dest), flag
            else:  # prose ("none", "detected", ...): the parser leaves it unset for the merge to decide
                assert action.default is None and not action.required, flag
            for choice in action.choices or ():
                assert f"`{choice}`" in line, f"{flag} accepts {choice!r}, which its README row does not name"
    assert sorted(set(options) - documented) == [], "merge options missing from README's table"


def test_every_option_has_help_text():
    for name, sub in _subparsers(build_parser()).items():
        for flag, action in _options(sub).items():
            assert action.help, f"merger {name} {flag} has no help text"


@pytest.mark.parametrize("args, expected", [
    (["merge", "--local-dri", "ckpt", "--target_dir", "out"], "unknown flag --local-dri (did you mean --local-dir?)"),
    (["merge", *REQUIRED, "--max_shard_szie", "2GB"], "unknown flag --max_shard_szie (did you mean --max_shard_size?)"),
    (["test", "--local_dir", "ckpt", "--test-hf-dri", "ref"], "(did you mean --test-hf-dir?)"),
    (["merge", *REQUIRED, "--backend", "fdsp"], "invalid choice: 'fdsp'"),
    (["merge", *REQUIRED, "--max_shard_size", "2XB"], "argument --max_shard_size/--max-shard-size: cannot read size"),
])
def test_a_mistyped_flag_or_value_fails_at_parse_time_with_a_hint(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert expected in last and "Traceback" not in last
