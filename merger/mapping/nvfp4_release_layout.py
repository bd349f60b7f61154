"""`--quantize_like` an NVFP4 release: a compressed-tensors `nvfp4-pack-quantized` one (llmcompressor's NVFP4A16,
or NVFP4 with activations) or a ModelOpt `NVFP4` export. The output is written as the release stores its weights,
quantized by the producing tool's own rule, with the scale shared across tensors shared as the release shares it.

A quantized weight `<m>.weight` [out, in] is stored as e2m1 codes uint8 [out, in / 2] (two a byte, the even element
in the low nibble), a float8_e4m3fn scale per group of 16 [out, in / 16], and one float32 scale for the tensor:
- compressed-tensors: `<m>.weight_packed`, `<m>.weight_scale`, `<m>.weight_global_scale` [1]; a group reads back as
  its codes times weight_scale / weight_global_scale (compressed_tensors_codec.nvfp4);
- ModelOpt: `<m>.weight` itself, `<m>.weight_scale`, `<m>.weight_scale_2` [] ; codes times weight_scale x
  weight_scale_2 (compressed_tensors_codec.modelopt_nvfp4).
The activations' calibration beside a weight (compressed-tensors' `<m>.input_global_scale` with NVFP4 W4A4,
ModelOpt's `<m>.input_scale`, in every NVFP4 export) is copied from the release: merger has no data to calibrate on,
and the format needs it. A release whose bytes are not here (a Hub id's) cannot give it, and is refused then.

The rules, on the weights at --dtype (amax: the largest magnitude):
- compressed-tensors 0.20: the global scale (`generate_gparam`) 448 x 6 / amax computed in the weights' dtype,
  stored as float32; a group's scale (`calculate_qparams`) its amax / 6 in the weights' dtype times the global
  scale in float32, clamped to ±448 and rounded to float8 (0 becomes 0.125, float8's eps as compressed-tensors takes
  it); each code (`quantize`, `cast_to_fp4`, `pack_fp4_to_uint8`) the weight over (scale / global scale) in float32;
- ModelOpt 0.47 (`NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=...)`): weight_scale_2 amax in float32 /
  (6 x 448); a group's scale its amax in float32 / (6 x weight_scale_2) (0 becomes 1), clamped to [2^-9, 448] and
  rounded to float8; each code the weight over (scale x weight_scale_2) in float32;
- both round a code to e2m1 as e2m1_pack.pack_e2m1 does (ties to the even code, ±6 at most, -0 for
  a negative weight that rounds to 0).

The shared scale: vLLM fuses q/k/v and gate/up, and the tools give such layers one scale computed on their largest
amax (llmcompressor's `update_fused_layer_weight_global_scales` takes the smallest global scale, ModelOpt's export
`preprocess_linear_fusion` the largest amax): llmcompressor's `oneshot` and ModelOpt across q/k/v and across
gate/up, its `model_free_ptq` across q/k/v only. Which layers share is read off the release: the q/k/v (gate/up,
DeepSeek's q_a_proj/kv_a_proj_with_mqa, Mixtral's w1/w3) of each module of a kind (its name with the layer and
expert numbers left out) share one where their stored shared scales are equal in every module of that kind (a Hub
id's release, whose bytes are not read: q/k/v and gate/up, as oneshot and ModelOpt).

Kept bytes (release_blocks.py): where every weight of a sharing set (or a weight of its own) holds the release's
values, it is the release's bytes. Where one changed, the set's shared scale is computed again, by the tool's rule,
from all of its weights as they now are; if it is the release's, each group of 16 whose values are the release's
keeps its codes and scale and the others are quantized; if it is not, every group of every member (the unchanged
ones too) is quantized with the new shared scale, as the tool would write the whole fused layer: a kept byte would
read back at another scale. The values read back from a release seldom have the largest magnitude of the weights
it was made of (a group's float8 scale rounds), so compressed-tensors' global scale, 448 x 6 / amax, mostly comes
out another after any change to its set; ModelOpt's, amax / (6 x 448), mostly comes out the same.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import MergerError
from ..hf_folder import read_config
from .compressed_tensors_codec import modelopt_nvfp4, nvfp4
from .e2m1_pack import E2M1_MAX, pack_e2m1
from .fp8_release_layout import FLAG, packed_release, readable
from .quantized_check import E2M1_HALF_STEP
from .quantized_formats import QUANTIZATION_CONFIG
from .release_blocks import StoredTensor, as_read, keep, unchanged_blocks
from .steps import OutputSpec

NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"  # compressed-tensors' format
MODELOPT_NVFP4 = "NVFP4"  # ModelOpt's quant_algo
GROUP = 16
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FP8_EPS = 0.125  # what compressed-tensors writes for a group scale of 0 (its _get_dtype_eps of float8)
FP8_SMALLEST = 2.0**-9  # ModelOpt clamps a group's scale to [2^-9, 448] (and makes one of 0 1.0 before)
# the half step of a float8 e4m3 scale: 2^-4 of it in the normal range, 2^-10 among the subnormals
E4M3_HALF_ULP, E4M3_SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10
# the layers whose global scales llmcompressor's oneshot and ModelOpt share, by the last part of their module's name
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# llmcompressor 0.14's FUSED_LAYER_NAMES: FUSED, DeepSeek's MLA down-projections, Mixtral's w1/w3. A release's bytes
# say which of these its tool shared (shared_groups); one whose bytes are not read is taken to share FUSED only
ONESHOT_FUSED = (*FUSED, ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))


def _amax(weights: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of `weights` taken as one tensor, in their dtype."""
    return torch.stack([w.abs().amax() for w in weights]).amax()


def compressed_tensors_global(weights: list[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: compressed-tensors' global scale of `weights` taken as one tensor (generate_gparam: 448 x 6 /
    amax in their dtype; the smallest of each one's, as llmcompressor shares them)."""
    amax = _amax(weights).clamp(min=torch.finfo(weights[0].dtype).tiny)
    return torch.nan_to_num(FP8_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def compressed_tensors_quantize(weight: torch.Tensor, gscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [..., n / 2], float8 scales [..., n / 16]) of `weight` by compressed-tensors' rule with
    global scale `gscale`: a group's scale is amax / 6 in the weight's dtype times `gscale` in float32, rounded to
    float8 (0: 0.125); each code the weight over (scale / gscale)."""
    groups = weight.unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1)
    scales = (gscale * (amax / torch.tensor(E2M1_MAX, dtype=weight.dtype))).clamp(-FP8_MAX, FP8_MAX)
    scales = scales.to(FP8).to(torch.float32)
    scales = torch.where(scales == 0, FP8_EPS, scales)
    return pack_e2m1((groups / (scales / gscale).unsqueeze(-1)).flatten(-2)), scales.to(FP8)


def modelopt_global(weights: list[torch.Tensor]) -> torch.Tensor:
    """float32 []: ModelOpt's weight_scale_2 of `weights` taken as one tensor (get_weights_scaling_factor_2: amax in
    float32 / (6 x 448); the export's preprocess_linear_fusion takes the fused layers' largest amax)."""
    return _amax(weights).to(torch.float32) / (E2M1_MAX * FP8_MAX)


def modelopt_quantize(weight: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, float8 scales) of `weight` by ModelOpt's NVFP4QTensor.quantize with `scale_2`: a group's scale
    is its amax in float32 / (6 x scale_2) (0: 1.0), clamped to [2^-9, 448] and rounded to float8; each code the
    weight over (scale x scale_2)."""
    groups = weight.unflatten(-1, (-1, GROUP))
    scales = groups.abs().amax(-1).to(torch.float32) / (E2M1_MAX * scale_2)
    scales = torch.where(scales == 0, 1.0, scales).clamp(FP8_SMALLEST, FP8_MAX).to(FP8)
    return pack_e2m1((groups / (scales.to(torch.float32) * scale_2).unsqueeze(-1)).flatten(-2)), scales


@dataclass(frozen=True)
class Producer:
    """What differs between the two NVFP4 writers: the tool's name, the parts `<m>.weight` is stored as (suffixes of
    its name: codes, group scales, the scale shared across the tensor; and of its module's name: the activations'
    calibration), the shared scale's shape, its rule, the quantizer given it, the reader, and a group's step as a
    function of its float8 scale and the shared scale."""

    name: str
    parts: tuple[str, str, str]
    calibration: str
    global_shape: tuple[int, ...]
    global_of: Callable[[list[torch.Tensor]], torch.Tensor]
    quantize: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    read: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


COMPRESSED_TENSORS = Producer("compressed-tensors", ("_packed", "_scale", "_global_scale"), ".input_global_scale",
                              (1,), compressed_tensors_global, compressed_tensors_quantize, nvfp4,
                              lambda scale, gscale: scale / gscale)
MODELOPT = Producer("ModelOpt", ("", "_scale", "_scale_2"), ".input_scale", (), modelopt_global, modelopt_quantize,
                    modelopt_nvfp4, lambda scale, scale_2: scale * scale_2)


def shared_groups(here: frozenset[str], release: dict[str, StoredTensor] | None, shared_part: str,
                  fused: tuple[tuple[str, ...], ...] = FUSED) -> list[frozenset[str]]:
    """The sets of quantized weights (by name) that share a global scale: the fused layers of one module (`fused`),
    of every module of a kind (its name with the layer and expert numbers left out) whose fused layers have equal
    shared scales (`<m>.weight` + `shared_part`) in the release, in each module of that kind; every fused set, for
    a release whose bytes are not read.

    A kind, not a module: a tool shares by the kind of layer (model_free_ptq q/k/v but not a routed expert's
    gate/up), and two scales the tool did not share may still be equal. In model_free_ptq's NVFP4 of a Qwen3-MoE
    about half the experts' gate and up came out with equal global scales: read as shared, a trained gate would
    have had its untouched up quantized again."""
    found = []
    for names in fused:
        modules: dict[str, list[str]] = {}
        for name in sorted(here):
            parent, _, leaf = name.removesuffix(".weight").rpartition(".")
            if leaf in names and name.endswith(".weight"):
                modules.setdefault(parent, []).append(name)
        sets = {parent: members for parent, members in modules.items() if len(members) > 1}
        if release is not None:
            unshared = {_kind(parent) for parent, members in sets.items()
                        if len({release[m + shared_part].read().numpy().tobytes() for m in members}) > 1}
            sets = {parent: members for parent, members in sets.items() if _kind(parent) not in unshared}
        found += [frozenset(members) for members in sets.values()]
    return found


def _kind(module: str) -> str:
    """A module's name with its numbers (layer, expert) left out: `model.layers.#.mlp.experts.#`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", module)


@dataclass(frozen=True)
class Nvfp4Output:
    """How an NVFP4 output is written: which outputs are quantized (by name), the dtypes the other tensors take
    (the release's), config.json's quantization_config (the release's), the producer's rules, the release's
    tensors, whose bytes unchanged groups keep (None: a Hub id's, every group quantized), the weights that share a
    global scale (quantized_steps.py quantizes each such set in one step), whether the release stores the
    activations' calibration beside each weight (copied from it), and files written beside config.json (a
    ModelOpt export's hf_quant_config.json)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    producer: Producer = COMPRESSED_TENSORS
    release: dict[str, StoredTensor] | None = None
    shared: list[frozenset[str]] = field(default_factory=list)
    calibrated: frozenset[str] = frozenset()
    files: dict[str, str] = field(default_factory=dict)

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and spec.rows is None

    def _calibration(self, name: str) -> str:
        return name.removesuffix(".weight") + self.producer.calibration

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        out, cols = spec.shape
        codes, scale, shared = (spec.name + part for part in self.producer.parts)
        return (OutputSpec(codes, (out, cols // 2), torch.uint8), OutputSpec(scale, (out, cols // GROUP), FP8),
                OutputSpec(shared, self.producer.global_shape, torch.float32),
                *((OutputSpec(self._calibration(spec.name), self.producer.global_shape, torch.float32),)
                  if spec.name in self.calibrated else ()))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        return self.quantize_together({spec.name: tensor})[spec.name]

    def quantize_together(self, weights: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Each of `weights` (the quantized outputs of one step) quantized, each set of them that shares a global
        scale (`shared`: quantized_steps.py joined their steps) together, every other one on its own: a step that
        writes layers the release does not share a scale among (a Megatron fc1's gate and up, for model_free_ptq)
        gives each its own."""
        sets = [members & weights.keys() for members in self.shared if members & weights.keys()]
        alone = weights.keys() - set().union(*sets)
        out = {}
        for members in [*sets, *({name} for name in sorted(alone))]:
            out.update(self._quantize_set({name: weights[name] for name in sorted(members)}))
        return out

    def _quantize_set(self, weights: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """`weights`, which share one global scale (or one weight), quantized: the release's bytes where their values
        and the global scale are the release's (the module docstring); the activations' calibration, where the
        release has one, the release's."""
        rule = self.producer
        calibration = {name: [self.release[self._calibration(name)].read()] if name in self.calibrated else []
                       for name in weights}
        if self.release is None:
            shared = rule.global_of(list(weights.values()))
            return {name: [*rule.quantize(w, shared), shared] for name, w in weights.items()}
        stored = {name: [self.release[name + part].read() for part in rule.parts] for name in weights}
        grids = {name: unchanged_blocks(as_read(rule.read(*stored[name]), w), (1, GROUP)) for name, w in weights.items()}
        if all(grid.all() for grid in grids.values()):  # nothing changed: no quantizing
            return {name: stored[name] + calibration[name] for name in weights}
        shared = rule.global_of(list(weights.values()))
        same = all(torch.equal(shared.view(torch.int32), s[2].view(torch.int32)) for s in stored.values())
        out = {}
        for name, w in weights.items():
            packed, scales = rule.quantize(w, shared)
            if same:
                packed = keep(grids[name].repeat_interleave(GROUP // 2, dim=-1), stored[name][0], packed)
                scales = keep(grids[name], stored[name][1], scales)
            out[name] = [packed, scales, shared, *calibration[name]]
        return out

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py). The bound is e2m1's half
        step times the group's step, plus what rounding the group's scale to float8 may have left beyond ±6 (half a
        float8 step, and 2^-7 for compressed-tensors' rounding of amax / 6 to bfloat16 before it, times 6)."""
        packed, scales, shared = parts[:3]
        scale = scales.to(torch.float32)
        half_ulp = torch.maximum(scale * E4M3_HALF_ULP, torch.tensor(E4M3_SUBNORMAL_HALF_STEP))
        bound = E2M1_HALF_STEP * scale + E2M1_MAX * (half_ulp + scale * 2.0**-7)
        bound = self.producer.step(bound, shared.to(torch.float32))
        return self.producer.read(packed, scales, shared), bound.repeat_interleave(GROUP, dim=-1)


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]], producer: Producer = COMPRESSED_TENSORS,
                   files: tuple[str, ...] = ()) -> Nvfp4Output:
    """How to write `outputs` (name -> shape) as the NVFP4 release in `folder` (its scheme checked by
    config_format) stores them; `files`: the release's files beside config.json that the output gets too. The
    activations' calibration (W4A4's `input_global_scale`, ModelOpt's `input_scale`) is copied from the release,
    which a Hub id's release (its bytes not here) cannot give: refused."""
    tensors, here, dtypes = packed_release(folder, outputs, producer.parts, 2, GROUP)
    calibrated = sorted(name for name in tensors if name.endswith(producer.calibration)
                        and name.removesuffix(producer.calibration) + ".weight" in here)
    weights = frozenset(name.removesuffix(producer.calibration) + ".weight" for name in calibrated)
    release = readable(tensors)
    if calibrated and release is None:
        raise MergerError(f"{producer.name} NVFP4 with its activations calibrated ({len(calibrated)} "
                          f"{producer.calibration.lstrip('.')}, e.g. {calibrated[0]}) as {FLAG}'s release: merger "
                          f"copies the calibration from the release's files, and only their headers are here (a Hub "
                          f"id): download the release and name its folder, {folder}")
    return Nvfp4Output(here, dtypes, read_config(folder)[QUANTIZATION_CONFIG], producer, release,
                       shared_groups(here, release, producer.parts[2], FUSED if release is None else ONESHOT_FUSED),
                       weights,
                       {name: (folder / name).read_text() for name in files})
