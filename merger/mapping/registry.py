"""Which mapping a checkpoint gets, decided in one place: the first mapper in MAPPERS that claims its catalog.

A mapper turns the catalog's names into steps (mapping/steps.py): LoRA modes first (adapter folders given to
`merger lora`, an adapter saved alone, a PEFT-wrapped model), then the naming conventions (Megatron and
torchtitan through the family's record, families.py; a FP8 block-scaled, compressed-tensors or ModelOpt HF
release dequantized; HF names as they are).
The tie and dtype policy and the config changes the output's class needs are applied once, to whichever
mapping was built. Adding a naming is one
module with `claims` and `build`, and a row here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..catalog import Catalog
from ..errors import MergerError
from ..hf_folder import local_config_folder
from ..options import MergeOptions
from . import compressed_tensors, fp8, hf, megatron, megatron_vlm, modelopt, torchtitan
from .lora import adapter_folders, adapter_state, megatron_lora_model, megatron_peft, megatron_shards, peft_state
from .lora.flags import LORA_FLAGS, refuse_unused
from .model_class import config_updates
from .policy import apply_policy
from .modelopt_scheme import MODELOPT_CONFIG
from .quantized_formats import QUANTIZATION_CONFIG, describes_none_of
from .steps import Mapping


@dataclass(frozen=True)
class Mapper:
    name: str
    claims: Callable[[Catalog, MergeOptions], bool]
    build: Callable[[Catalog, MergeOptions], Mapping]
    flags: frozenset[str] = frozenset()  # the LoRA flags it takes; any other one given is an error
    family: bool = False  # it maps by a Megatron family's rows, which --family FILE may give


MAPPERS = (
    Mapper("adapter folders", adapter_folders.claims, adapter_folders.build, LORA_FLAGS),
    Mapper("adapter-only LoRA", adapter_state.claims, adapter_state.build, LORA_FLAGS),
    Mapper("PEFT-wrapped model", peft_state.claims, peft_state.build, LORA_FLAGS - {"base_model"}),
    # the adapter's own adapter_config.json gives r, alpha and the rest
    Mapper("verl Megatron LoRA", megatron_peft.claims, megatron_peft.build, frozenset({"base_model", "lora"})),
    # Megatron-Bridge's shards: r off their shapes, lora_alpha from the flags
    Mapper("verl Megatron LoRA shards", megatron_shards.claims, megatron_shards.build, LORA_FLAGS, family=True),
    Mapper("Megatron model with LoRA shards", megatron_lora_model.claims, megatron_lora_model.build,
           LORA_FLAGS - {"base_model"}, family=True),
    # a VLM: its text model under `language_model.`, its vision tower under `vision_model.`
    Mapper("Megatron VLM", megatron_vlm.claims, megatron_vlm.build),
    Mapper("megatron", megatron.claims, megatron.build, family=True),
    Mapper("torchtitan", torchtitan.claims, torchtitan.build),
    # HF names whose config.json says FP8 blocks; asking decides the stored format (quantized_formats.py), and one
    # merger does not read is refused there
    Mapper("FP8 block-scaled HF", fp8.claims, fp8.build),
    Mapper("compressed-tensors HF", compressed_tensors.claims, compressed_tensors.build),
    Mapper("ModelOpt HF", modelopt.claims, modelopt.build),
    Mapper("hf", hf.claims, hf.build),
)


def mapper_for(catalog: Catalog, options: MergeOptions) -> Mapper:
    for mapper in MAPPERS:
        if mapper.claims(catalog, options):
            return mapper
    raise MergerError(f"no mapping for {catalog.naming} tensor names, {catalog.root}")


def build_mapping(catalog: Catalog, options: MergeOptions) -> Mapping:
    """The steps writing `catalog` as the target, after the tie and dtype policy, with the config updates."""
    mapper = mapper_for(catalog, options)
    refuse_unused(mapper.flags, options, catalog)
    if options.family is not None and not mapper.family:
        raise MergerError(f"--family gives the rows of a Megatron checkpoint's family, and this {catalog.format} "
                          f"checkpoint is mapped as {mapper.name}, {catalog.root}")
    mapping = mapper.build(catalog, options)
    if mapping.hf_dir is not None:
        mapping.hf_dir = local_config_folder(mapping.hf_dir)  # a base model in a bucket: its config, fetched
    mapping = apply_policy(mapping, options)
    if mapping.hf_dir is not None and _keeps_a_stale_quantization_config(mapping):
        mapping.config_removals += (QUANTIZATION_CONFIG,)
        # ModelOpt's own description of its export says the same, to loaders that read it (vLLM)
        modelopt = (MODELOPT_CONFIG,) if (mapping.hf_dir / MODELOPT_CONFIG).is_file() else ()
        mapping.files_left_out += modelopt
        mapping.notes += (f"merger: {QUANTIZATION_CONFIG} of {mapping.hf_dir / 'config.json'} left out of "
                          f"config.json{f' (and {MODELOPT_CONFIG} not copied)' if modelopt else ''}: the output "
                          f"holds no quantized weight",)
    if mapping.hf_dir is not None:  # a model: its config.json may need another class, labels, ...
        outputs = {o.name: o.shape for s in mapping.steps for o in s.outputs}
        mapping.config_updates = {**config_updates(mapping.config, outputs, options.is_value_model, mapping.hf_dir),
                                  **mapping.config_updates}
    return mapping


def _keeps_a_stale_quantization_config(mapping: Mapping) -> bool:
    """The config's quantization_config would be copied (no mapper set or removed it) though the output holds
    no quantized tensor (quantized_formats.describes_none_of)."""
    if QUANTIZATION_CONFIG in mapping.config_updates or QUANTIZATION_CONFIG in mapping.config_removals:
        return False
    return describes_none_of(mapping.config, {o.name for s in mapping.steps for o in s.outputs if o.file is None})
