"""Source names to output tensors: the steps a plan is built from.

Checkpoints whose keys are already HF names (verl FSDP, HF-named DCP) map one to one with a cast; torchtitan
Llama names are renamed and rotary-permuted (torchtitan_llama.py). Tied output embeddings are written once,
as save_pretrained does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from ..engine.plan import OutputSpec, Step, output_dtype
from ..errors import MergerError
from ..options import MergeOptions
from . import torchtitan as torchtitan_llama
from .saved_names import rename_outputs, saved_names

TIED_OUTPUT = "lm_head.weight"


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise MergerError(f"no config.json (pass --hf_model_config_path), {hf_dir}") from e
    except (OSError, json.JSONDecodeError) as e:
        raise MergerError(f"cannot read config.json ({e}), {path}") from e


def ties_embeddings(config: dict) -> bool:
    """transformers' rule: a top-level flag, else the text config's; PretrainedConfig defaults it to True."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", True))


def hf_steps(catalog: Catalog, config: dict, options: MergeOptions) -> list[Step]:
    names = list(catalog.tensors)
    if (options.tie_word_embedding or ties_embeddings(config)) and TIED_OUTPUT in names and len(names) > 1:
        names.remove(TIED_OUTPUT)
    steps = []
    for name in names:
        t = catalog.tensors[name]
        steps.append(Step((name,), (OutputSpec(name, t.shape, output_dtype(t.dtype, options.torch_dtype)),)))
    return steps


def build_steps(catalog: Catalog, config: dict, options: MergeOptions, hf_dir: Path) -> list[Step]:
    if catalog.format.startswith("megatron"):
        from .megatron import megatron_steps  # Megatron names need their family's table

        return megatron_steps(catalog, config, options)
    if torchtitan_llama.wanted(catalog, options):
        ties = options.tie_word_embedding or ties_embeddings(config)
        return torchtitan_llama.torchtitan_steps(catalog, config, options, ties)
    steps = hf_steps(catalog, config, options)
    names = [o.name for s in steps for o in s.outputs]
    return rename_outputs(steps, saved_names(hf_dir, config, names, options.trust_remote_code))


@dataclass
class Mapping:
    """The steps, plus what the target needs beside the weights."""

    steps: list[Step]
    config_updates: dict = field(default_factory=dict)  # keys to set in the target's config.json
    extra_files: dict[str, str] = field(default_factory=dict)  # path relative to the target -> text
    notes: tuple[str, ...] = ()  # what the merge found and does, for the log


def build_mapping(catalog: Catalog, config: dict, options: MergeOptions, hf_dir: Path) -> Mapping:
    from .lora.peft_state import is_peft_state, peft_state_mapping, refuse_lora_flags

    if is_peft_state(catalog):  # a PEFT-wrapped model: fold its LoRA adapter, write it as lora_adapter/
        return peft_state_mapping(catalog, config, options)
    refuse_lora_flags(options, catalog)
    return Mapping(build_steps(catalog, config, options, hf_dir))
