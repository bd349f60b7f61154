"""Whether an experts module stores its 3-D tensors [experts, in, out] (transformers' `is_transposed`, gpt-oss)
or [experts, out, in], asked of the model's own class: PEFT reads the attribute off the module it wraps. Only a
square tensor needs the answer (the adapter's shapes tell the others apart), so the model is built, on the
meta device, only then."""
from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Callable

from ..meta_model import meta_model

log = logging.getLogger("merger")


def experts_transposed(hf_dir: Path, config: dict, trust_remote_code: bool) -> Callable[[str], bool | None]:
    """module name -> whether it stores its experts transposed; None where transformers cannot build the model
    or has no such module."""
    @cache
    def model():
        try:
            return meta_model(hf_dir, config, trust_remote_code)
        except Exception as e:  # noqa: BLE001 - any failure to build the class leaves the question unanswered
            log.debug("merger: cannot build the model's class to ask its experts' layout (%s)", e)
            return None

    def ask(module: str) -> bool | None:
        built = model()
        try:
            return bool(getattr(built.get_submodule(module), "is_transposed", False)) if built is not None else None
        except AttributeError:
            return None

    return ask
