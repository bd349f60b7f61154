"""The command line against its documentation: the `merge` options table of docs/options.md and the parser agree,
every option has help text, a misspelled flag or backend fails at parse time with a hint, and every relative link
in README.md and docs/ leads to a file that exists."""
from __future__ import annotations

import argparse
import pathlib
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


def _options_table_rows() -> list[tuple[list[str], list[str], str]]:
    """(flags, default of each flag, whole row) for every row of the `merge` options table in docs/options.md."""
    text = (ROOT / "docs" / "options.md").read_text()
    table = text[text.index("## `merge` options"):].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        flags_cell, default_cell, _ = (c.strip() for c in line.strip("|").split("|"))
        flags = [f.split()[0] for f in re.findall(r"`([^`]+)`", flags_cell)]
        defaults = [d.strip() for d in default_cell.split(",")]
        rows.append((flags, defaults, line))
    return rows


def _parsed(*args: str):
    return build_parser().parse_args(["merge", *REQUIRED, *args])


def test_options_table_matches_the_merge_parser():
    """Every flag in the table exists with the documented default, every choice is named in its row, and every
    merge option has a row."""
    options = _options(_subparsers(build_parser())["merge"])
    documented = set()
    for flags, defaults, line in _options_table_rows():
        assert len(flags) == len(defaults), f"one default per flag: {line}"
        for flag, default in zip(flags, defaults):
            assert flag in options, f"docs/options.md documents {flag}, which merge does not take"
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
                assert f"`{choice}`" in line, f"{flag} accepts {choice!r}, which its docs/options.md row does not name"
    assert sorted(set(options) - documented) == [], "merge options missing from the table in docs/options.md"


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


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(page: pathlib.Path) -> list[str]:
    """Targets of the page's markdown links and images that are paths in this repository, fragments cut off; code
    blocks and code spans are left out (a command's `[...](...)` is not a link)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = (m.split()[0].split("#")[0] for m in re.findall(r"\]\(([^)]+)\)", text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_existing_files(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in _relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in DOC_PAGES[1:] if p.resolve() not in linked]
    assert unlinked == [], f"docs pages README.md does not link: {unlinked}"
