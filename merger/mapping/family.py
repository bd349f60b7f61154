"""A model family as one typed record, and the rows its tables are made of.

A `Row` maps one source tensor: its name (after the layer prefix for a layer row), its kind (kinds.py: the
shape rule and transform that make it HF's) and the HF names it becomes (after `model.layers.{i}.` for a layer
row; `{e}` is the expert number). A skip gives no names but the reason HF has no place for the tensor. A join
(a kind with a `cat_dim`) writes its source and the tensors it names in `joined` as one HF tensor, where HF
fuses what the framework keeps apart; a `stacked` Megatron row writes every expert's tensor as one [E, ...] HF
tensor, where HF keeps the experts stacked (gpt-oss). Rows are checked when built, so a table with an unknown
kind, a rename with several targets or a reasonless skip fails at import, naming the row.

A `Family` holds what merger knows of one model family: the config.json model types it writes, its layer rows
under each training framework's names (Megatron's, torchtitan's; none: that framework's checkpoints of it are
not mapped), what tells its torchtitan checkpoints apart and what of them it leaves out (a vision tower its text
model has no place for), the VLMs whose text model it is, the vision tower it writes for a VLM's config.json,
where HF keeps its multi-token-prediction layers (none: HF has none for it), the row counts config.json fixes, and
what tells a hybrid's layer types apart (checked against config.json's `layer_types`). The records are in
families.py; adding a family is adding a record, or for one that only renames, writing it as a file
(family_file.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from .kinds import KINDS


@dataclass(frozen=True)
class Row:
    source: str
    kind: str
    targets: tuple[str, ...] = ()
    reason: str = ""  # why a skip (or a row left out for want of `only_with`) has no HF name
    # A tensor of the same layer the row needs beside it (named as `source` is): without it the tensor is a
    # placeholder, left out for `reason` (torchtitan's MLA builds a query norm even without q-LoRA).
    only_with: str = ""
    # Tensors of the same layer (named as `source` is) a join writes after `source`, in this order, in its one HF
    # tensor: torchtitan's in_proj_k and in_proj_v after in_proj_q in HF's in_proj_qkv.
    joined: tuple[str, ...] = ()
    # Megatron's experts (`{e}` in `source`, none in the targets) written as one [E, ...] tensor, expert 0 first,
    # the kind's plan applied to that stack: transformers keeps gpt-oss's experts stacked on disk.
    stacked: bool = False

    def __post_init__(self):
        kind = KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"row {self.source!r}: unknown kind {self.kind!r} (known: {', '.join(KINDS)})")
        if bool(self.joined) != (kind.cat_dim is not None):
            raise ValueError(f"row {self.source!r}: a {self.kind} row "
                             f"{'names no tensors to join' if self.joined else 'joins no tensors'}")
        if not isinstance(self.targets, tuple) or len(self.targets) != kind.targets:
            raise ValueError(f"row {self.source!r}: a {self.kind} row has {kind.targets} HF name(s), not "
                             f"{self.targets!r}")
        if (kind.targets == 0 or self.only_with) and not self.reason:
            raise ValueError(f"row {self.source!r}: a {self.kind} row{' with only_with' if self.only_with else ''} "
                             f"needs the reason the tensor has no HF name")
        if self.stacked and ("{e}" not in self.source or kind.per_expert):
            raise ValueError(f"row {self.source!r}: only a row of one expert ({{e}}) stacks the experts")
        # `{e}` comes from the source's name (Megatron's local_experts.{e}) or from a per-expert stack
        numbered = ("{e}" in self.source and not self.stacked) or kind.per_expert
        if any(("{e}" in t) != numbered for t in self.targets):
            raise ValueError(f"row {self.source!r}: its HF names {self.targets!r} "
                             f"{'lack' if numbered else 'hold'} the expert number {{e}}")

    def pattern(self, prefix: str) -> re.Pattern:
        """The source names this row maps after regex `prefix`, with the expert number as group `e`."""
        return re.compile(prefix + re.escape(self.source).replace(r"\{e\}", r"(?P<e>\d+)"))


def joined_part(row: Row, part: str) -> Row:
    """The row a tensor that `row` joins is found by: written by `row`, never on its own."""
    return Row(part, "joined", reason=f"written with {row.source} as {row.targets[0]}")


def sources_once(rows: tuple[Row, ...], where: str) -> None:
    """A table names each source once (a join's parts too): a second row for it would never be reached."""
    seen = set()
    for source in (name for row in rows for name in (row.source, *row.joined)):
        if source in seen:
            raise ValueError(f"row {source!r} appears twice in {where}")
        seen.add(source)


@dataclass(frozen=True)
class VisionTower:
    """A VLM's vision tower (torchtitan's, Megatron's), written whole where config.json is the HF VLM's: its tensors
    under their own naming (globals named in full, block rows after `blocks` and block i, written after
    `hf_blocks`; other numbered module lists as `lists`), and the text model's names moved under the VLM's
    (`text_prefixes`: each (text model's prefix, the VLM's))."""
    model_types: tuple[str, ...]  # the HF VLMs' config.json model types
    prefix: str  # the names of the tower's tensors start with it
    blocks: str  # then block i and a dot
    hf_blocks: str  # where HF keeps block i's rows
    globals: tuple[Row, ...]
    rows: tuple[Row, ...]
    text_prefixes: tuple[tuple[str, str], ...]  # where the VLM keeps what the text model keeps under `model.`...
    # Numbered module lists beside the blocks, each (the prefix before module i, where HF keeps module i, its rows):
    # Qwen3-VL's deepstack mergers
    lists: tuple[tuple[str, str, tuple[Row, ...]], ...] = ()

    def text_name(self, name: str) -> str:
        return next((new + name[len(old):] for old, new in self.text_prefixes if name.startswith(old)), name)


@dataclass(frozen=True)
class MtpLayout:
    """Where HF keeps a family's multi-token-prediction layers, and which config.json key counts them.

    DeepSeek-V3's (the defaults): MTP layer j is HF layer `model.layers.{L + j}.` after the L decoder layers, with
    its own tensors under it (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the names the namings give) and the
    embedding and output layer again (`shared`). Qwen3-Next's and Qwen3.5's: MTP layer j's transformer layer is
    `mtp.layers.{j}.`, its own tensors have names of their own outside it (`mtp.fc`), once for the model, so HF
    holds one MTP layer, and the embedding and output layer are the model's."""
    count_key: str  # config.json's count of MTP layers
    layer: str = ""  # where HF keeps MTP layer {j}'s transformer layer; "": as decoder layer L + j
    # The namings' HF names of an MTP layer's own tensors -> this family's full names, where HF keeps them outside
    # the layer (once: such a family holds one MTP layer)
    own: dict[str, str] = field(default_factory=dict)
    shared: bool = True  # HF holds the embedding and output layer again in each MTP layer

    def __post_init__(self):
        if self.own and not self.layer:
            raise ValueError(f"MTP layout {self.count_key}: its own tensors' names need the layer's name too")


@dataclass(frozen=True)
class Family:
    name: str  # in messages, and torchtitan's --model torchtitan-<name>
    model_types: tuple[str, ...]  # config.json model types it writes
    megatron: tuple[Row, ...] = ()  # layer rows after `decoder.layers.{i}.`
    torchtitan: tuple[Row, ...] = ()  # layer rows after `layers.{i}.`
    # Layer names only this family's torchtitan checkpoints hold (no other family's torchtitan rows name them):
    # they tell it apart; the one torchtitan family without any is what names nothing else marks are.
    torchtitan_marks: tuple[str, ...] = ()
    torchtitan_any_config: bool = False  # its torchtitan names fit any model_type's config (a plain Llama's)
    # Name prefixes of the torchtitan checkpoint's tensors outside the HF model written, with why: a vision tower
    # the text model has no place for. They are left out and counted in the merge's note, never refused.
    torchtitan_left_out: tuple[tuple[str, str], ...] = ()
    # HF model types (VLM wrappers) whose text model this family writes: their config.json is refused, naming
    # the text config to pass instead
    text_model_of: tuple[str, ...] = ()
    # Its torchtitan checkpoints' vision tower, written whole (with the text model under the VLM's names) where
    # config.json is one of the HF VLMs it names
    torchtitan_vision: VisionTower | None = None
    # The same for its Megatron VLM checkpoints (the text model under `language_model.`, the tower beside it)
    megatron_vision: VisionTower | None = None
    # Its text model is written only inside its VLM: transformers has no causal LM of its text config alone
    # (Qwen3-VL-MoE's qwen3_vl_moe_text), so a Megatron checkpoint without the tower is refused
    vlm_only: bool = False
    mtp: MtpLayout | None = None  # where HF keeps its MTP layers; None: HF has no MTP layers for it
    # HF layer-row name -> the row count config.json fixes for it, for tensors a TP layout could leave ambiguous
    config_rows: dict[str, Callable[[dict], int]] = field(default_factory=dict)
    # (prefix, replacement) of the HF names, where HF keeps the model elsewhere than `model.embed_tokens`,
    # `model.layers`, `model.norm` (the names the rows give): the names save_pretrained writes
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    # A hybrid's layer types: config.json's `layer_types` value -> the Megatron row only a layer of that type
    # holds. Each checkpoint layer is checked against config.json's pattern, which decides HF's modules.
    layer_types: dict[str, str] = field(default_factory=dict)
    file: str = ""  # the family file it was read from (family_file.py); "": a record of families.py

    def hf_name(self, name: str) -> str:
        return next((new + name[len(old):] for old, new in self.hf_prefixes if name.startswith(old)), name)

    def vlm_types(self) -> tuple[str, ...]:
        """The HF VLMs' model types around its text model: those it refuses, naming the text config, and those it
        writes with a vision tower."""
        towers = (self.torchtitan_vision, self.megatron_vision)
        return self.text_model_of + tuple(t for tower in towers if tower for t in tower.model_types)

    def __post_init__(self):
        for naming, rows in (("Megatron", self.megatron), ("torchtitan", self.torchtitan)):
            sources_once(rows, f"the {self.name} family's {naming} rows")
            for row in rows:
                if row.kind == "joined":
                    raise ValueError(f"row {row.source!r} of the {self.name} family: a joined tensor is named in "
                                     f"the `joined` of the row that writes it")
        for row in self.megatron:  # the Megatron mapper maps every row it matches: it has no skip to honour
            if row.kind == "skip" or row.only_with or row.joined:
                raise ValueError(f"row {row.source!r} of the {self.name} family: Megatron rows name weights, "
                                 f"one each (the named rules of sources/megatron_skips.py leave the rest out)")
        if self.vlm_only and not self.megatron_vision:
            raise ValueError(f"family {self.name}: written only inside its VLM, but it names no vision tower")
        sources = {row.source for row in self.torchtitan}
        for mark in self.torchtitan_marks:
            if mark not in sources:
                raise ValueError(f"family {self.name}: mark {mark!r} is none of its torchtitan rows")
        for layer_type, source in self.layer_types.items():
            if not any(row.source == source for row in self.megatron):
                raise ValueError(f"family {self.name}: layer type {layer_type!r} is told by {source!r}, which is none "
                                 f"of its Megatron rows")
        targets = {t for row in self.megatron for t in row.targets}
        for name in self.config_rows:
            if name not in targets:
                raise ValueError(f"family {self.name}: config row count for {name!r}, which no Megatron row writes")
