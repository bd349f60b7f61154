"""A training framework's naming, and the table a family's rows compile to under it.

A naming says where its decoder layers are (`decoder.layers.{i}.`, `layers.{i}.`), which global rows every
family shares, and where it keeps multi-token-prediction layers: the MTP layer's own rows, its transformer layer
through the family's layer rows, and the shared embedding and output layer HF may hold again as that layer's own
(`shared`). Where HF keeps them is the family's MtpLayout (family.py): by default MTP layer j after the L decoder
layers is HF layer `model.layers.{L + j}.`, as DeepSeek-V3's checkpoints hold them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .family import MtpLayout, Row, VisionTower, joined_part, sources_once


@dataclass(frozen=True)
class MtpNaming:
    prefix: str  # then the MTP layer number j and a dot
    layer: tuple[str, ...]  # after `{prefix}{j}.`: where its transformer layer holds the family's layer rows
    rows: tuple[Row, ...]  # the MTP layer's own rows, after `{prefix}{j}.`
    shared: tuple[Row, ...]  # global tensors every MTP layer holds again, as HF names under its layer
    tied_source: str = ""  # where a shared tensor comes from when the checkpoint lacks it (a tied output layer)


@dataclass(frozen=True)
class Naming:
    name: str  # in messages: "Megatron tensor ..."
    decoder: str  # then the decoder layer number i and a dot
    globals: tuple[Row, ...]  # rows of tensors outside the layers, named in full
    mtp: MtpNaming | None  # None: it holds no multi-token-prediction layers
    hf_layer: str = "model.layers.{i}."  # where HF keeps layer i's rows

    def __post_init__(self):
        sources_once(self.globals, f"{self.name}'s global rows")
        if self.mtp:
            sources_once(self.mtp.rows, f"{self.name}'s MTP rows")


@dataclass(frozen=True)
class Entry:
    pattern: re.Pattern  # with groups i (decoder layer), j (MTP layer), e (expert) as the name holds them
    row: Row
    targets: tuple[str, ...]  # the row's HF names, under `model.layers.{i}.` for a layer row


def compile_table(naming: Naming, rows: tuple[Row, ...], mtp: MtpLayout | None = None) -> list[Entry]:
    """Global rows, then each layer row for decoder layers and for MTP layers (a join's parts as rows of their
    own, kind joined), then the MTP layers' own rows, written where the family's `mtp` layout keeps them."""
    def in_layer(row: Row, layer: str = naming.hf_layer) -> tuple[str, ...]:
        return tuple(layer + t for t in row.targets)

    mtp_layer = (mtp and mtp.layer) or naming.hf_layer
    own = mtp.own if mtp else {}
    table = [Entry(row.pattern(""), row, row.targets) for row in naming.globals]
    rows = (*rows, *(joined_part(row, part) for row in rows for part in row.joined))
    table += [Entry(row.pattern(re.escape(naming.decoder) + r"(?P<i>\d+)\."), row, in_layer(row)) for row in rows]
    if naming.mtp:
        prefix = re.escape(naming.mtp.prefix) + r"(?P<j>\d+)\."
        inner = "(?:" + "|".join(map(re.escape, naming.mtp.layer)) + ")"
        table += [Entry(row.pattern(prefix + inner), row, in_layer(row, mtp_layer)) for row in rows]
        table += [Entry(row.pattern(prefix), row, tuple(own.get(t) or mtp_layer + t for t in row.targets))
                  for row in naming.mtp.rows]
    return table


def tower_table(tower: VisionTower, name: str) -> list[Entry]:
    """A vision tower's table: its globals, its block rows, and the rows of each of its other numbered lists."""
    table = compile_table(Naming(name, tower.blocks, tower.globals, None, tower.hf_blocks), tower.rows)
    for prefix, hf, rows in tower.lists:
        table += compile_table(Naming(name, prefix, (), None, hf), rows)
    return table


def lookup(table: list[Entry], name: str, first_mtp: int) -> tuple[Row, tuple[str, ...]] | None:
    """The row naming source tensor `name` and the HF names it becomes (MTP layer j is HF layer first_mtp + j where
    the layout numbers it after the decoder layers; a per-expert row's names keep `{e}`), or None."""
    for entry in table:
        m = entry.pattern.fullmatch(name)
        if m:
            groups = m.groupdict()
            j = groups.get("j")
            if j is not None:
                groups["i"] = first_mtp + int(j)
            groups.setdefault("e", "{e}")
            return entry.row, tuple(t.format(**groups) for t in entry.targets)
    return None
