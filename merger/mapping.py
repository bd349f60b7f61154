"""Source names to output tensors: the steps a plan is built from.

Checkpoints whose keys are already HF names (verl FSDP, HF-named DCP) map one to one with a cast. Tied
output embeddings are written once, as save_pretrained does.
"""
from __future__ import annotations

import json
from pathlib import Path

from .catalog import Catalog
from .errors import MergerError
from .options import MergeOptions
from .plan import OutputSpec, Step, output_dtype

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


def config_updates(config: dict, options: MergeOptions) -> dict:
    """A value model is saved as its family's token-classification model with one label."""
    if not options.is_value_model:
        return {}
    archs = [a.replace("ForCausalLM", "ForTokenClassification") for a in config.get("architectures") or []]
    return {"architectures": archs, "num_labels": 1}


def build_steps(catalog: Catalog, config: dict, options: MergeOptions) -> list[Step]:
    if catalog.format.startswith("megatron"):
        from .megatron.families import megatron_steps  # Megatron names need their family's table

        return megatron_steps(catalog, config, options)
    return hf_steps(catalog, config, options)
