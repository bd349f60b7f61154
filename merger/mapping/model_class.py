"""Which transformers class the output is: the `architectures` (and label count) written into its config.json.

verl saves the config it started from, so a critic trained from a causal LM arrives with
`architectures: [XForCausalLM]` although its weights carry a token-classification head (`score.weight`,
one label) instead of `lm_head`. `--is-value-model` rewrites the config to `XForTokenClassification`;
without it such a checkpoint is refused rather than written as a model that would load with a random head.
Models whose config already names their class (reward models as `XForSequenceClassification`, VLMs as
`XForConditionalGeneration`, remote code through `auto_map`) keep it.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import MergerError

HEAD = "score.weight"
SUFFIXES = ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification", "Model")


def _base_name(config: dict) -> str | None:
    for arch in config.get("architectures") or []:
        for suffix in SUFFIXES:
            if arch.endswith(suffix):
                return arch[: -len(suffix)]
    return None


def _labels(n: int) -> dict:
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(n)}, "label2id": {f"LABEL_{i}": i for i in range(n)}}


def check_remote_code(config: dict, hf_dir: Path) -> None:
    """Every module config.json's auto_map names must be a .py file beside it: the output gets a copy of each."""
    for value in (config.get("auto_map") or {}).values():
        for ref in value if isinstance(value, list) else [value]:
            if ref and "--" not in ref:  # "repo--module.Class" lives in another Hub repo, loaded from there
                module = ref.rsplit(".", 1)[0]
                if not (hf_dir / f"{module}.py").is_file():
                    raise MergerError(f"config.json's auto_map names {ref} but {module}.py is not in the config "
                                      f"folder, {hf_dir}")


def config_updates(config: dict, outputs: dict[str, tuple[int, ...]], is_value_model: bool,
                   hf_dir: Path) -> dict:
    """Changes to config.json for the output; `outputs` maps output names to shapes."""
    check_remote_code(config, hf_dir)
    archs = config.get("architectures") or []
    if is_value_model:
        if HEAD not in outputs:
            raise MergerError(f"--is-value-model needs a value head {HEAD} in the checkpoint, which has none "
                              f"(is this an actor checkpoint?), {hf_dir / 'config.json'}")
        base = _base_name(config)
        if base is None:
            raise MergerError(f"cannot name the token-classification class: config.json has architectures "
                              f"{archs}, {hf_dir / 'config.json'}")
        return {"architectures": [f"{base}ForTokenClassification"], **_labels(outputs[HEAD][0])}
    if HEAD in outputs and "lm_head.weight" not in outputs and any(a.endswith("ForCausalLM") for a in archs):
        raise MergerError(f"the checkpoint has a value head {HEAD} and no lm_head, but config.json says "
                          f"{archs[0]}: pass --is-value-model for a critic, {hf_dir / 'config.json'}")
    return {}
