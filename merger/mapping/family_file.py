"""A model family a user writes as a file (`--family FILE`, TOML or JSON): its Megatron layer rows and the config.json
model types it maps, read into the same typed record as the built-in families (family.py), so a family that only
renames what merger reads needs no new release of merger (docs/families.md).

The file is checked as the records of families.py are: each row by Row, the whole by Family, and every row against
sources/megatron_tp.py's TP splits. A file names text models: a model type that a built-in family knows as a VLM
around its text model is refused, since the mapping would otherwise differ with the file's presence. Whatever fails
is one line naming the file and the entry (`megatron[2]`: the file's third row).
"""
from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path

from ..errors import MergerError
from .families import FAMILIES, tp_split_known
from .family import Family, Row
from .megatron_rows import MEGATRON
from .naming import Entry

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib: tomli is the same parser (pyproject installs it there)
    import tomli as tomllib

# The keys a file may hold, each with its type: what a family of renames needs. A family needing more (MTP layers,
# config.json row counts, torchtitan rows) is a record in families.py.
FAMILY_KEYS = {"name": str, "model_types": list, "megatron": list, "hf_prefixes": list, "layer_types": dict}
ROW_KEYS = {"source": str, "kind": str, "targets": list, "stacked": bool}
REQUIRED = ("name", "model_types", "megatron")


def _parsed(path: Path) -> dict:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MergerError(f"cannot read the family file: {e}, {path}") from e
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise MergerError(f"the family file is not valid {path.suffix[1:].upper()}: {e}, {path}") from e
    raise MergerError(f"a family file is TOML (.toml) or JSON (.json), not {path.suffix or 'a file without a suffix'}, "
                      f"{path}")


def _checked_keys(table: object, keys: dict, where: str, path: Path) -> dict:
    if not isinstance(table, dict):
        raise MergerError(f"{where} is a {type(table).__name__}, not a table of {', '.join(keys)}, {path}")
    for key, value in table.items():
        if key not in keys:
            raise MergerError(f"{where} has the unknown key {key!r} (known: {', '.join(keys)}), {path}")
        if not isinstance(value, keys[key]):
            raise MergerError(f"{where}'s {key} is a {type(value).__name__}, not a {keys[key].__name__}, {path}")
    return table


def _strings(value: list, where: str, path: Path) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in value):
        raise MergerError(f"{where} holds {value!r}: strings only, {path}")
    return tuple(value)


def _row(entry: object, where: str, path: Path) -> Row:
    table = _checked_keys(entry, ROW_KEYS, where, path)
    missing = [k for k in ("source", "kind") if k not in table]
    if missing:
        raise MergerError(f"{where} has no {' and no '.join(missing)}, {path}")
    try:
        return Row(table["source"], table["kind"], _strings(table.get("targets", []), f"{where}'s targets", path),
                   stacked=table.get("stacked", False))
    except ValueError as e:  # Row's own check, as for a built-in row
        raise MergerError(f"{where}: {e}, {path}") from e


def _pairs(value: list, where: str, path: Path) -> tuple[tuple[str, str], ...]:
    if not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise MergerError(f"{where} holds {value!r}: pairs [HF prefix, saved prefix] only, {path}")
    return tuple(_strings(p, where, path) for p in value)


def _refuse_vlm_types(family: Family, path: Path) -> None:
    """A built-in family's VLM model type names no text model a Megatron checkpoint holds."""
    for builtin in FAMILIES:
        for model_type in set(family.model_types).intersection(builtin.vlm_types()):
            raise MergerError(f"model type {model_type!r} is the HF VLM around the {builtin.name} family's text model "
                              f"({', '.join(builtin.model_types)}): a family file names the text model's model type, "
                              f"{path}")


def read_family(path: Path) -> Family:
    """The family `path` describes, checked as a built-in record is; MergerError naming the file and the entry."""
    table = _checked_keys(_parsed(path), FAMILY_KEYS, "the family file", path)
    missing = [k for k in REQUIRED if k not in table]
    if missing:
        raise MergerError(f"the family file has no {', no '.join(missing)} (docs/families.md shows one), {path}")
    rows = tuple(_row(entry, f"megatron[{i}]", path) for i, entry in enumerate(table["megatron"]))
    model_types = _strings(table["model_types"], "model_types", path)
    if not rows or not model_types:
        raise MergerError(f"the family file names no {'model types' if rows else 'Megatron rows'}, {path}")
    layer_types = table.get("layer_types", {})
    _strings(list(layer_types.values()), "layer_types", path)
    try:
        family = Family(table["name"], model_types, megatron=rows, layer_types=layer_types, file=str(path),
                        hf_prefixes=_pairs(table.get("hf_prefixes", []), "hf_prefixes", path))
        tp_split_known((family,))
    except ValueError as e:  # Family's and families.py's checks, as for a built-in record
        raise MergerError(f"{e}, {path}") from e
    _refuse_vlm_types(family, path)
    return family


def _shape_of(name: str) -> str:
    """A name with its layer and expert numbers made alike, to compare a tensor's name with a row's source."""
    return re.sub(r"\d+", "N", name.removeprefix(MEGATRON.decoder))


def misspelt_row(family: Family, table: list[Entry], names, unmapped: str) -> tuple[Row, str] | None:
    """Of a file family's rows that no tensor in `names` matches, the one whose source is nearest `unmapped`'s name
    (a tensor no row maps) if it is near enough to be a misspelling of it, with the name that row expects (decoder
    layer 0, expert 0); else None. A row that matches nothing is no error alone: a file may name both Megatron layer
    specs' tensors (a norm fused into linear_qkv, or on its own), and a checkpoint holds one."""
    wanted = _shape_of(unmapped)
    near = []
    for row in family.megatron:
        ratio = difflib.SequenceMatcher(None, _shape_of(f"{MEGATRON.decoder}0.{row.source}"), wanted).ratio()
        patterns = [entry.pattern for entry in table if entry.row is row]
        if ratio >= 0.9 and not any(p.fullmatch(n) for p in patterns for n in names):
            near.append((ratio, row))
    if not near:
        return None
    row = max(near, key=lambda pair: pair[0])[1]  # the first of the nearest: max keeps the first of equals
    return row, f"{MEGATRON.decoder}0.{row.source.replace('{e}', '0')}"
