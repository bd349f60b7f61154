"""DeepSpeed's model_states and optim_states files, loaded weights-only with inert stand-ins for its classes.

optim_states pickles name three DeepSpeed classes beside the tensors (deepspeed 0.19.8): the loss scaler, the
ZeRO stage enum and, at stage 1/2, `fragment_address` (a param's place in this rank's partition). Merger never
imports deepspeed: each name resolves to a stand-in defined here, which builds nothing from the pickle but the
stage number, so a crafted file cannot reach any other code. Every other global stays refused by the
weights-only unpickler. The files are memory-mapped: the optimizer moments stored beside the fp32 partitions
are never read.
"""
from __future__ import annotations

import enum

from ..errors import MergerError
from .safe_load import torch_load


class ZeroStageEnum(int, enum.Enum):
    """deepspeed.runtime.zero.config.ZeroStageEnum's members; pickled as `ZeroStageEnum(value)`."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Ignored:
    """Stands in for a DeepSpeed object merger does not need: its pickled state is dropped, not kept."""

    def __setstate__(self, state) -> None:
        pass


class LossScaler(_Ignored):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler"""


class FragmentAddress(_Ignored):
    """deepspeed.utils.tensor_fragment.fragment_address (merger computes param places from param_shapes)"""


_STAND_INS = (
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)


def load_states(path: str, what: str) -> dict:
    """A model_states or optim_states file as a dict, memory-mapped (no tensor's bytes are read)."""
    state = torch_load(path, what, safe_globals=_STAND_INS)
    if not isinstance(state, dict):
        raise MergerError(f"{what} holds a {type(state).__name__}, not a dict, {path}")
    return state
