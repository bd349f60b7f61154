"""`merger lora`: fold PEFT adapter folders, in order, into a HF safetensors base model, streaming the base.

The base folder (the checkpoint) and every adapter become one catalog (adapter k's tensors under the prefix
`adapter{k}:`), the fold rules in fold_steps.py give the steps, and the usual merge writes the target, with
the base's config and tokenizer files (config `tie_word_embeddings: false` when an adapter untied the
embeddings). `fold_into_base` is shared with adapter-only checkpoints given a base model (adapter_state.py).
"""
from __future__ import annotations

from pathlib import Path

from ...catalog import Catalog
from ...errors import MergerError
from ...hf_folder import local_config_folder, read_config, weight_files
from ...io import is_remote, location
from ...io.locations import ObjectPath
from ...options import MergeOptions
from ...sources import hf_safetensors
from ...sources.peft_adapter import open_adapter_catalog
from ...sources.union import union_catalog
from ..hub_folders import hub_id_of
from ..policy import ties
from ..quantized_formats import QUANTIZATION_CONFIG
from ..steps import Mapping, Step
from .adapter import LoraAdapter, adapter_from_folder
from .experts_orientation import experts_transposed
from .fold_steps import fold_steps
from .module_names import adapter_names, under_own_names
from .quantized_base import base_weights, dequantizing_inputs


def open_base(base_dir: Path) -> Catalog:
    if not base_dir.is_dir():
        raise MergerError(f"base model folder does not exist, {base_dir}")
    if not hf_safetensors.detect(base_dir):
        raise MergerError(f"no safetensors weights in the base model folder, {base_dir}")
    return hf_safetensors.open_catalog(base_dir)


def base_folder(catalog: Catalog, options: MergeOptions) -> Path | ObjectPath | None:
    """The base model of an adapter: --base_model, else the HF weights saved beside it (mbridge's
    `model/huggingface/` in a verl Megatron LoRA save), else None."""
    if options.base_model is not None:
        return location(options.base_model)
    return catalog.hf_dir if catalog.hf_dir and weight_files(catalog.hf_dir) else None


def base_model_name(base_dir: str | Path) -> str:
    """What the adapter's config records as its base_model_name_or_path: the Hub id of a base taken from the Hub
    cache (`--base_model owner/name`), which loads anywhere, else the folder's absolute path."""
    where = location(base_dir)
    return (hub_id_of(where) if not is_remote(where) else None) or str(where.absolute())


def fold_into_base(base: Catalog, parts: dict[str, Catalog], adapters: list[LoraAdapter], options: MergeOptions,
                   fmt: str, side_steps: tuple[Step, ...] = (), extra_files: dict[str, str] | None = None,
                   notes: tuple[str, ...] = (), folds: tuple[Step, ...] = ()) -> Mapping:
    """`base` (a HF folder's catalog) with `adapters` folded in; `parts` maps each adapter catalog to its name
    prefix. `side_steps` and `extra_files` add outputs beside the model (an adapter folder); `folds` write base
    tensors themselves (an adapter folded by other rules), which are then not copied."""
    base_dir = location(base.root)
    catalog = union_catalog({"": base, **parts}, base_dir, fmt)
    config = read_config(base_dir)
    written = {o.name for s in folds for o in s.outputs}
    # a quantized release: its weights are dequantized, folded, then requantized or cast; a format the fold cannot
    # read is refused (quantized_base.py)
    weights = base_weights(base)
    tensors = {**{n: t for n, t in catalog.tensors.items() if n not in base.tensors}, **weights.tensors}
    # the fold reads the base under the names the adapters give its modules, and writes it under its own
    names = adapter_names(local_config_folder(base_dir), config, list(weights.tensors), adapters,
                          options.trust_remote_code)
    result = fold_steps({names.get(n, n): n for n in weights.tensors if n not in written}, adapters, tensors,
                        ties(config, options),
                        experts_transposed(local_config_folder(base_dir), config, options.trust_remote_code))
    folded, renamed = under_own_names(result.steps, names)
    steps, notes = folded + list(folds), (*notes, *renamed)
    quantized = bool(weights.dequantizers)
    if quantized:  # folds by other rules (Megatron-Bridge's shards) read the base too
        steps = dequantizing_inputs(steps, weights.dequantizers)
        notes = (*notes, f"merger: the base is {weights.described}: its weights are dequantized before the fold "
                         f"(--dtype keep writes them back in its layout)")
    return Mapping(steps + list(side_steps), base_dir, config,
                   config_updates={"tie_word_embeddings": False} if result.untied else {},
                   config_removals=(QUANTIZATION_CONFIG,) if quantized else (),
                   files_left_out=weights.files_left_out, extra_files=dict(extra_files or {}), notes=notes,
                   catalog=catalog, quantize_like=base_dir if quantized else None)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    return bool(options.adapters)


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    """The checkpoint is the base model; `options.adapters` are folded into it in order."""
    if catalog.format != "hf_safetensors":
        raise MergerError(f"the base model must be a HF safetensors folder, and this is a {catalog.format} "
                          f"checkpoint, {catalog.root}")
    parts = {f"adapter{k}:": open_adapter_catalog(location(folder)) for k, folder in enumerate(options.adapters)}
    adapters = [adapter_from_folder(location(folder), f"adapter{k}:", parts[f"adapter{k}:"])
                for k, folder in enumerate(options.adapters)]
    return fold_into_base(catalog, parts, adapters, options, "hf_safetensors+peft_adapter")
