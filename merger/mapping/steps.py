"""What a mapper hands the planner: steps (source tensors in, named output tensors out) and a Mapping around them.

A `Step` is either a cast (one source tensor written under a name, in the output dtype: the planner may place
its pieces straight from the reading rank into the file) or a transform (a pure function of whole source
tensors, run where the step is written). A step may write a slab of an output, rows [lo, hi) of its first dim
(`OutputSpec.rows`), which other steps write the rest of: HF's experts stacked [E, ...] in one tensor (gpt-oss)
are written an expert a step, so no rank ever holds the whole stack. Mappers declare each output in its natural
dtype, the dtype of the source it comes from; the tie and dtype policy (policy.py) then decides once what is
written and in which dtype.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..catalog import Catalog
from ..safetensors_io import FP4_X2, nbytes_of

Transform = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# stored scaled: a cast alone loses the scale (FP4_X2: DeepSeek-V4's FP4 experts, two codes a byte, too)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, *((FP4_X2,) if FP4_X2 is not None else ()))
# the dtype merger dequantizes a quantized release's weights in (fp8.py, compressed_tensors.py): a dequantized
# weight's natural dtype, which the dtype policy then casts to --dtype
DEQUANTIZED = torch.float32


@dataclass(frozen=True)
class OutputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # A file of its own beside the model's weights (e.g. `lora_adapter/adapter_model.safetensors`), left out of
    # the model's index, whose tensors keep the dtype they are declared in; None: one of the model's files.
    file: str | None = None
    # The rows [lo, hi) of `shape`'s first dim that this spec's step writes; the steps writing one output's slabs
    # tile its rows, each with the same name, shape (the whole tensor's), dtype and file. None: the whole tensor.
    rows: tuple[int, int] | None = None

    @property
    def written_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the step produces for this spec: the whole output's, or its slab's."""
        return self.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def nbytes(self) -> int:
        """The bytes the step writes for this spec (a slab's, for a slab)."""
        return nbytes_of(self.written_shape, self.dtype)


@dataclass(frozen=True)
class Step:
    """Whole source tensors in, output tensors out (each of its spec's written_shape: a slab's, for a slab).
    `transform` is pure; None makes the step a cast of its one input. The writer casts every result to its spec's
    dtype."""

    inputs: tuple[str, ...]
    outputs: tuple[OutputSpec, ...]
    transform: Transform | None = None

    @property
    def is_cast(self) -> bool:
        return self.transform is None

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors if self.transform is None else self.transform(tensors)


def cast(source: str, name: str, shape: tuple[int, ...], dtype: torch.dtype, file: str | None = None) -> Step:
    """The step writing source tensor `source` as output `name`."""
    return Step((source,), (OutputSpec(name, shape, dtype, file),))


def output_dtype(source: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """The cast a merge applies: floating tensors take the wanted dtype, integer buffers keep theirs."""
    return wanted if wanted is not None and source.is_floating_point else source


@dataclass(frozen=True)
class Tie:
    """A tied model's output embedding, left out of the written files: `step` would write it (lm_head.weight),
    `kept` names the output it is tied to, the input embedding (None: the mapping names none the policy knows).
    The merge compares the two before the plan is fixed (engine/tie_check.py), and `--verify` compares the
    source's lm_head with the written input embedding."""

    step: Step
    kept: str | None


@dataclass
class Mapping:
    """A mapper's answer: the steps, and what the target needs beside the weights."""

    steps: list[Step]
    hf_dir: Path | None  # config and tokenizer come from here; None: the target is no model (an adapter folder)
    config: dict  # hf_dir's config.json ({} without one)
    _: KW_ONLY  # the rest by name: a field added later can never shift another's value
    config_updates: dict = field(default_factory=dict)  # keys to set in the target's config.json
    # top-level keys to delete from it: what the written weights no longer are (a dequantized model's
    # quantization_config); a key both set and deleted is deleted
    config_removals: tuple[str, ...] = ()
    # files of hf_dir not copied beside the weights: what describes weights the output no longer holds (a
    # dequantized ModelOpt export's hf_quant_config.json)
    files_left_out: tuple[str, ...] = ()
    extra_files: dict[str, str] = field(default_factory=dict)  # path relative to the target -> text
    notes: tuple[str, ...] = ()  # what the merge found and does, for the log
    catalog: Catalog | None = None  # what the steps read when it is more than the checkpoint (a base model too)
    tie: Tie | None = None  # set by the tie policy (policy.py): lm_head.weight, left out as tied
    # an FP8 release whose layout the output keeps under --dtype keep (a LoRA folded into an FP8 base)
    quantize_like: Path | None = None
