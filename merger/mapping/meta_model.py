"""The installed transformers' model for a config.json, built on the meta device (no memory, no weights), for
questions only the model's own classes answer (which modules transformers quantizes, how an experts module
stores its tensors)."""
from __future__ import annotations

from pathlib import Path

import torch


def meta_model(hf_dir: Path, config: dict, trust_remote_code: bool) -> torch.nn.Module:
    """The model class config.json names (no architectures: the causal LM of its model_type, as AutoModel picks
    it). ValueError for remote code or a class the installed transformers lacks."""
    import transformers

    archs = config.get("architectures") or []
    model_class = getattr(transformers, archs[0], None) if archs else None
    if "auto_map" in config or (archs and model_class is None):
        raise ValueError("remote code, or no class of that name in the installed transformers")
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return model_class(hf_config) if model_class else transformers.AutoModelForCausalLM.from_config(hf_config)
