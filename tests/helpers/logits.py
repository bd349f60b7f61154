"""A merged model's output as transformers computes it, to compare with the training library's own."""
from pathlib import Path

import torch


def hf_logits(folder: Path, tokens: torch.Tensor, critic: bool) -> torch.Tensor:
    """The merged model's logits (values for a critic); it must load with no missing or unexpected key."""
    import transformers

    auto = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits
