"""LoRA flags given for a checkpoint whose mapping would ignore them: an error saying so, never a silent no-op."""
from __future__ import annotations

from ...catalog import Catalog
from ...errors import MergerError
from ...options import MergeOptions

LORA_FLAGS = frozenset({"base_model", "adapter_config", "lora", "lora_r", "lora_alpha"})


def refuse_unused(accepted: frozenset[str], options: MergeOptions, catalog: Catalog) -> None:
    """Raise for the first LoRA flag given that the chosen mapping does not take (`accepted`)."""
    if options.base_model is not None and "base_model" not in accepted:
        raise MergerError(f"--base_model applies to adapter-only checkpoints (accelerate's adapter_only DCP save, "
                          f"verl's save_lora_only), and this {catalog.format} checkpoint holds a whole model, "
                          f"{catalog.root}")
    for option, flag, given in (("adapter_config", "--adapter_config", options.adapter_config is not None),
                                ("lora", "--lora separate", options.lora == "separate"),
                                ("lora_r", "--lora_r", options.lora_r is not None),
                                ("lora_alpha", "--lora_alpha", options.lora_alpha is not None)):
        if given and option not in accepted and accepted:  # a LoRA mapping that takes the adapter's own config
            raise MergerError(f"{flag} does not apply to a {catalog.format} checkpoint: its adapter_config.json "
                              f"gives r, lora_alpha and the rest, {catalog.root}")
        if given and option not in accepted:
            raise MergerError(f"{flag} applies to checkpoints with a LoRA adapter, and this {catalog.format} "
                              f"checkpoint has none (no lora_A / lora_B tensors), {catalog.root}")
