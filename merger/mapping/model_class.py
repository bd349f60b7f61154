"""Which transformers class the output is: the `architectures` (and label count) written into its config.json.

verl saves the config it started from, so a critic trained from a causal LM arrives with
`architectures: [XForCausalLM]` although its weights carry a token-classification head (`score.weight`,
one label) instead of `lm_head`. `--is-value-model` rewrites the config to `XForTokenClassification`;
without it such a checkpoint is refused rather than written as a model that would load with a random head.
Models whose config already names their class (reward models as `XForSequenceClassification`, VLMs as
`XForConditionalGeneration`, remote code through `auto_map`) keep it.

The class also says which modules transformers keeps in float32 at a lower dtype (`keep_in_fp32`): read off the
class attributes, without building the model. Importing a model's transformers module costs a rank 1.5-3 s and
~170 MB on this project's 2-core machine, and most families keep nothing in float32: their modeling source is
read first, as text, and the class imported only where that source names the attribute.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import torch

from ..errors import MergerError

log = logging.getLogger("merger")

HEAD = "score.weight"
SUFFIXES = ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification", "Model")


def _base_name(config: dict) -> str | None:
    for arch in config.get("architectures") or []:
        for suffix in SUFFIXES:
            if arch.endswith(suffix):
                return arch[: -len(suffix)]
    return None


def _classes(config: dict) -> list[type]:
    """The transformers classes of the model and of its sub-models (a VLM's text and vision models, whose keep-in-fp32
    lists transformers' post_init adds to the top model's), by the names config.json gives; remote code has none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = list(config.get("architectures") or [])
    names += [MODEL_MAPPING_NAMES.get(sub.get("model_type")) for sub in config.values()
              if isinstance(sub, dict) and isinstance(sub.get("model_type"), str)]
    return [cls for cls in (getattr(transformers, n, None) for n in names if n) if isinstance(cls, type)]


KEEP_IN_FP32 = "_keep_in_fp32_modules"
# A modeling module's imports of another model's modeling module, whose classes it may subclass.
_SIBLING_IMPORT = re.compile(r"^from \.\.(\w+)\.(modeling_\w+) import", re.MULTILINE)


def _model_types(config: dict) -> list[str]:
    return [c["model_type"] for c in (config, *config.values())
            if isinstance(c, dict) and isinstance(c.get("model_type"), str)]


def _sources_name_it(config: dict) -> bool:
    """Whether the modeling sources of the config's model types (and those they import classes from) name the
    keep-in-fp32 attributes; True too where a source cannot be found, so the class is asked."""
    spec = importlib.util.find_spec("transformers")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return False  # no transformers: no class to ask
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    todo = [(t.replace("-", "_"), f"modeling_{t.replace('-', '_')}") for t in _model_types(config)]
    seen = set()
    while todo:
        folder, module = todo.pop()
        if (folder, module) in seen:
            continue
        seen.add((folder, module))
        try:
            text = (models / folder / f"{module}.py").read_text()
        except OSError:
            return True
        if KEEP_IN_FP32 in text:
            return True
        todo += _SIBLING_IMPORT.findall(text)
    return False


def keep_in_fp32(config: dict, dtype: torch.dtype | None) -> tuple[str, ...]:
    """The module patterns transformers keeps in float32 when the model is loaded, and so saved, at `dtype`
    (modeling_utils' _get_dtype_plan): `_keep_in_fp32_modules_strict` at float16 and bfloat16,
    `_keep_in_fp32_modules` at float16 only. Each pattern is a regular expression searched in a tensor's name.
    The class is imported only when it can matter: a lower dtype, and modeling sources that name the lists."""
    if dtype not in (torch.float16, torch.bfloat16) or "auto_map" in config or not _sources_name_it(config):
        return ()
    try:
        classes = _classes(config)
    except Exception as e:  # noqa: BLE001 - transformers missing or its module failing to import: nothing to keep
        log.debug("merger: no keep-in-fp32 modules, transformers' model class unavailable (%s)", e)
        return ()
    patterns = set()
    for cls in classes:
        patterns.update(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            patterns.update(getattr(cls, "_keep_in_fp32_modules", None) or ())
    return tuple(sorted(patterns))


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
