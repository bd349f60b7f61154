"""The command line against its documentation: each command's options table in docs/options.md and its parser
agree, every option has help text, a misspelled flag or backend fails at parse time with one line and a hint (the
launcher's missing `--` too), what the parser answers alone is answered without importing torch, and every
relative link in README.md and docs/ leads to a file that exists."""
from __future__ import annotations

import argparse
import pathlib
import re

import pytest

import merger
from launcher.cli import main as launcher_main
from merger.cli import main
from merger.flags import build_parser, keyword_values, merge_options
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_merger

pytestmark = pytest.mark.interpreter

REQUIRED = ["--local_dir", "ckpt", "--target_dir", "out"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option by its first spelling (verl's, with underscores), help left out."""
    return {a.option_strings[0]: a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _options_table_rows(command: str) -> list[tuple[list[str], list[str], str]]:
    """(flags, default of each flag, whole row) for every row of the `command` options table in docs/options.md;
    a flag's first spelling only (`--base_model DIR` (also `--base`) gives `--base_model`)."""
    text = (ROOT / "docs" / "options.md").read_text()
    section = text[text.index(f"## `{command}` options"):]
    table = next(block for block in section.split("\n\n") if block.startswith("| flag |"))
    rows = []
    for line in table.splitlines()[2:]:
        flags_cell, default_cell, _ = (c.strip() for c in line.strip("|").split("|"))
        flags = [f.split()[0] for f in re.findall(r"`([^`]+)`", re.sub(r"\(also [^)]*\)", "", flags_cell))]
        defaults = [d.strip() for d in default_cell.split(",")]
        rows.append((flags, defaults, line))
    return rows


REQUIRED_OF = {"merge": REQUIRED, "test": ["--local_dir", "ckpt", "--test_hf_dir", "ref"],
               "lora": ["--base_model", "base", "--adapter", "a", "--target_dir", "out"],
               "upload": ["--target_dir", "out", "--hf_upload_path", "user/name"],
               "inspect": ["--local_dir", "ckpt"], "watch": ["--local_dir", "run", "--target_dir", "out"],
               "families": []}


def _parsed(command: str, *args: str):
    return build_parser().parse_args([command, *REQUIRED_OF[command], *args])


def _same_as_merges(action: argparse.Action, merge_options: dict[str, argparse.Action]) -> bool:
    """A flag another command shares with merge, spelt, defaulted and explained the same: merge's row covers it."""
    twin = merge_options.get(action.option_strings[0])
    return twin is not None and (twin.default, twin.help, twin.choices) == (action.default, action.help, action.choices)


@pytest.mark.parametrize("command", list(REQUIRED_OF))
def test_options_tables_match_the_parsers(command):
    """Every flag in the command's table exists with the documented default, every choice is named in its row,
    and every option of the command has a row (one it shares with merge, in merge's table)."""
    commands = _subparsers(build_parser())
    options, merge_options = _options(commands[command]), _options(commands["merge"])
    documented = set()
    for flags, defaults, line in _options_table_rows(command):
        assert len(flags) == len(defaults), f"one default per flag: {line}"
        for flag, default in zip(flags, defaults):
            assert flag in options, f"docs/options.md documents {flag}, which {command} does not take"
            action = options[flag]
            documented.add(flag)
            if default == "required":
                assert action.required, flag
            elif default == "off":
                assert action.nargs == 0 and action.default is False, flag
            elif re.fullmatch(r"`[^`]+`", default):  # a literal: as if given on the command line
                assert (getattr(_parsed(command), action.dest)
                        == getattr(_parsed(command, flag, default.strip("`")), action.dest)), flag
            else:  # prose ("none", "detected", ...): the parser leaves it unset for the merge to decide
                assert action.default is None and not action.required, flag
            for choice in action.choices or ():
                assert f"`{choice}`" in line, f"{flag} accepts {choice!r}, which its docs/options.md row does not name"
    missing = [f for f, a in options.items() if f not in documented and (command == "merge"
                                                                         or not _same_as_merges(a, merge_options))]
    assert missing == [], f"{command} options missing from its table in docs/options.md"


KEYWORDS = [  # (command, the API's keywords): values of every kind of flag, good and bad
    ("merge", dict(local_dir=pathlib.Path("ckpt"), target_dir=pathlib.Path("out"), dtype="bf16", max_shard_size=2000,
                   overwrite=True, verify=False, dist_timeout=5, lora_r=8, lora_alpha=16, prefix="")),
    ("merge", dict(local_dir="s3://bucket/ckpt", target_dir="s3://bucket/out/", max_inflight="1GiB", device="cpu",
                   model="torchtitan-llama", quantize="mxfp4", log_level="DEBUG", hf_model_config_path="Qwen/Qwen3")),
    ("merge", dict(local_dir="ckpt", target_dir="out", dtype="int8")),
    ("merge", dict(local_dir="ckpt", target_dir="out", dtype="fp8")),
    ("merge", dict(local_dir="ckpt", target_dir="out", lora_r=8.5)),
    ("merge", dict(local_dir="ckpt", target_dir="out", max_shard_size=0)),
    ("merge", dict(local_dir="ckpt", target_dir="gs://bucket/out")),
    ("merge", dict(local_dir="ckpt", target_dir="out", summary_json="s3://bucket/summary.json")),
    ("merge", dict(local_dir="ckpt", target_dir="out", backend="fdsp")),
    ("merge", dict(local_dir="ckpt", target_dir="out", quantize_like="ftp://host/release")),
    ("inspect", dict(local_dir="ckpt", merge_ranks=2, json=True)),
    ("inspect", dict(local_dir="ckpt", merge_ranks=0)),
    ("test", dict(local_dir="ckpt", test_hf_dir="ref", atol=1e-5, rtol=0)),
    ("test", dict(local_dir="ckpt", test_hf_dir="ref", atol="abc")),
]


@pytest.mark.parametrize("command, keywords", KEYWORDS)
def test_an_api_keyword_takes_what_its_flag_takes_and_refuses_the_rest_with_its_line(command, keywords):
    """The API checks its keywords without parsing a command line (flags.keyword_values): each comes out as the
    command line's parser makes the same flag's text, or fails with the parser's line for it."""
    argv = [command]
    for name, value in keywords.items():
        argv += [f"--{name}"] if value is True else [] if value is False else [f"--{name}", str(value)]
    try:
        parsed = vars(_subparsers(build_parser())[command].parse_args(argv[1:]))
    except merger.UsageError as e:
        with pytest.raises(merger.UsageError) as raised:
            keyword_values(command, keywords)
        assert str(raised.value) == str(e)
    else:
        values = keyword_values(command, keywords)
        assert values == parsed and merge_options(values) == merge_options(parsed)


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
    (["merge", *REQUIRED, "--max_shard_size", "0"], "argument --max_shard_size/--max-shard-size: cannot use size '0': "
                                                    "give 1 byte or more"),
    (["merge", *REQUIRED, "--dtype", "fp8"], "argument --dtype: 'fp8' is a quantized format, not a dtype to cast to: "
                                             "--quantize fp8-block writes it"),
    (["lora", "--base_model", "b", "--adapter", "a", "--target_dir", "out", "--dtype", "MXFP4"],
     "--quantize mxfp4 writes it"),
    (["merge", "--local_dir", "ckpt", "--target_dir", "hf://someone/model"],
     "argument --target_dir/--target-dir: merged models are written to a local folder or a bucket (s3://, gs://, "
     "az://), not to hf:// (--hf_upload_path USER/NAME publishes the merged model to the "
     "Hub), hf://someone/model"),
    (["merge", "--local_dir", "ckpt", "--target_dir", "https://example.com/m"], "not to https://"),
    (["merge", *REQUIRED, "--quantize_like", "hf://org/release"], "hf:// paths are not supported"),
])
def test_a_mistyped_flag_or_value_fails_at_parse_time_with_a_hint(args, expected, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("merger: error: ") and expected in err, err  # no usage block


def test_an_unknown_flag_is_named_once_with_where_to_look(capsys):
    assert main(["merge", *REQUIRED, "--verfy"]) == 2
    assert capsys.readouterr().err == ("merger: error: unknown flag --verfy (did you mean --verify?) (merger merge "
                                       "--help lists every flag)\n")


def test_version_and_the_top_level_help_name_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"merger {merger.__version__}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert all(f"    {command} " in shown for command in _subparsers(build_parser())), shown


ANSWERED_BY_THE_PARSER = [  # (argv, exit status, how stdout, or else the first line of stderr, starts)
    (["--version"], 0, f"merger {merger.__version__}"),
    (["--help"], 0, "usage: merger "),
    *(([command, "--help"], 0, f"usage: merger {command} ") for command in REQUIRED_OF),
    (["merge", *REQUIRED, "--bogus"], 2, "merger: error: unknown flag --bogus"),
    (["merge", *REQUIRED, "--dtype", "int8"], 2, "merger: error: argument --dtype: invalid choice: 'int8'"),
    (["merge", "--local_dir", "ckpt"], 2, "merger: error: the following arguments are required: --target_dir"),
]


@pytest.mark.parametrize("args, code, shown", [pytest.param(*case, id=" ".join(case[0]))
                                               for case in ANSWERED_BY_THE_PARSER])
def test_what_the_parser_answers_imports_no_torch(args, code, shown):
    """`python -m merger` with --version, a --help or a command line that does not parse answers without importing
    torch (2 s of CPU here, where these take a tenth of that): the modules the process imports, as Python lists
    them under PYTHONPROFILEIMPORTTIME (-X importtime), hold no torch."""
    proc = run_merger(*args, check=False, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == code and (proc.stdout.startswith(shown) if code == 0 else said[0].startswith(shown)), \
        (proc.stdout, said)
    assert "merger.cli" in imported and [m for m in imported if m.split(".")[0] == "torch"] == []


def test_lora_takes_merges_spelling_of_the_base_and_the_old_one():
    for flag in ("--base_model", "--base-model", "--base"):
        args = build_parser().parse_args(["lora", flag, "base", "--adapter", "a", "--target_dir", "out"])
        assert args.local_dir == pathlib.Path("base")


def test_launcher_without_the_separator_shows_the_command_with_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher_main(["local", "--nproc", "2", "merge", "--local_dir", "ckpt", "--target_dir", "out"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "launcher: error: put `--` before the merger's arguments: python -m launcher local --nproc 2 -- merge "
        "--local_dir ckpt --target_dir out")


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
