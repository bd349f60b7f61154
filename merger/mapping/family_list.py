"""What `merger families` prints: the built-in families (families.py), by the config.json model types they write and
the training frameworks whose checkpoints of them are mapped; or the family a file gives (family_file.py), row by
row, with the built-in families it replaces."""
from __future__ import annotations

from .families import FAMILIES
from .family import Family


def _frameworks(family: Family) -> str:
    # a family written only inside its VLM maps no Megatron checkpoint of its text model alone
    named = [name for name, rows in (("Megatron", family.megatron and not family.vlm_only),
                                     ("torchtitan", family.torchtitan)) if rows]
    if family.torchtitan_vision:
        named.append(f"torchtitan's VLM as {' or '.join(family.torchtitan_vision.model_types)}")
    if family.megatron_vision:
        named.append(f"Megatron's VLM as {' or '.join(family.megatron_vision.model_types)}")
    return ", ".join(named)


def built_in() -> list[str]:
    width = max(len(f.name) for f in FAMILIES)
    types = max(len(", ".join(f.model_types)) for f in FAMILIES)
    lines = [f"{'family':<{width}}  {'config.json model_type':<{types}}  mapped from"]
    lines += [f"{f.name:<{width}}  {', '.join(f.model_types):<{types}}  {_frameworks(f)}" for f in FAMILIES]
    return lines


def from_file(family: Family) -> list[str]:
    replaced = sorted({f.name for f in FAMILIES for t in family.model_types if t in f.model_types})
    instead = (f"; replaces the built-in {', '.join(replaced)} family for them" if replaced else
               "; no built-in family maps them")
    lines = [f"{family.name} (family file {family.file}): model_type {', '.join(family.model_types)}; Megatron "
             f"rows after decoder.layers.{{i}}. -> model.layers.{{i}}.{instead}"]
    width = max(len(row.source) for row in family.megatron)
    kinds = max(len(row.kind) for row in family.megatron)
    lines += [f"  {row.source:<{width}}  {row.kind:<{kinds}}  {', '.join(row.targets)}"
              for row in family.megatron]
    return lines
