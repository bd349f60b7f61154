"""A merged model's output as transformers computes it, to compare with the training library's own."""
from pathlib import Path

import torch


def assert_logits_of(folder: Path, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
    """The merged causal LM gives the logits of a model of its config built from `state` (an oracle's weights)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({n: t.float() for n, t in state.items()}, strict=True)
    with torch.no_grad():
        assert torch.equal(hf_logits(folder, tokens, critic=False), model.eval()(tokens).logits)


def hf_logits(folder: Path, tokens: torch.Tensor, critic: bool) -> torch.Tensor:
    """The merged model's logits (values for a critic); it must load with no missing or unexpected key."""
    import transformers

    auto = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits
