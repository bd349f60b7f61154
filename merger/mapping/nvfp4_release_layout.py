"""`--quantize_like` a compressed-tensors `nvfp4-pack-quantized` release (llmcompressor's NVFP4A16): the output
written as the release stores its weights, quantized by compressed-tensors' own rule, with the global scale shared
as the release shares it.

A quantized weight `<m>.weight` [out, in] is stored as `<m>.weight_packed` uint8 [out, in / 2] (two e2m1 codes a
byte, the even element in the low nibble), `<m>.weight_scale` float8_e4m3fn [out, in / 16] and
`<m>.weight_global_scale` float32 [1]; a group reads back as its codes times weight_scale / weight_global_scale
(compressed_tensors_codec.nvfp4).

The rule is compressed-tensors 0.20's, on the weights at --dtype, in the dtype they have:
- the global scale (`generate_gparam`): 448 x 6 / amax, amax the largest magnitude of the weight, computed in the
  weight's dtype and stored as float32. llmcompressor shares one global scale among the layers vLLM fuses
  (`update_fused_layer_weight_global_scales`: the smallest of theirs, which is this rule on their largest amax):
  `oneshot` across q/k/v and across gate/up, `model_free_ptq` across q/k/v only. Which layers share is read off the
  release: the q/k/v (and gate/up) of one module whose stored global scales are equal share one (a Hub id's
  release, whose bytes are not read: q/k/v and gate/up, as oneshot);
- a group's scale (`calculate_qparams`): its amax / 6 in the weight's dtype, times the global scale in float32,
  clamped to ±448 and rounded to float8 (0 becomes 0.125, float8's eps as compressed-tensors takes it);
- each code (`quantize`, `cast_to_fp4`, `pack_fp4_to_uint8`): the weight over (scale / global scale), in float32,
  clamped to ±6 and rounded to e2m1 as mxfp4_pack_release_layout.pack_e2m1 does.

Kept bytes (release_blocks.py): where every weight of a sharing group holds the release's values, the group is the
release's bytes. Where one changed, the group's global scale is computed again from all of its weights; if it is
the release's, each group of 16 whose values are the release's keeps its codes and scale and the others are
quantized; if it is not, every group of 16 of every member (the unchanged ones too) is quantized with the new
global scale, as compressed-tensors would write the whole fused layer: a kept byte would read back at another
scale.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MergerError
from ..hf_folder import read_config
from .compressed_tensors_codec import nvfp4
from .fp8_release_layout import FLAG, packed_release, readable
from .mxfp4_pack_release_layout import E2M1_MAX, pack_e2m1
from .quantized_check import E2M1_HALF_STEP
from .quantized_formats import QUANTIZATION_CONFIG
from .release_blocks import StoredTensor, as_read, keep, unchanged_blocks
from .steps import OutputSpec

NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
GROUP = 16
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FP8_EPS = 0.125  # what compressed-tensors writes for a group scale of 0 (its _get_dtype_eps of float8)
# the half step of a float8 e4m3 scale: 2^-4 of it in the normal range, 2^-10 among the subnormals
E4M3_HALF_ULP, E4M3_SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10
PACKED, SCALE, GLOBAL = "_packed", "_scale", "_global_scale"  # `<m>.weight` -> `<m>.weight_packed`, ...
INPUT_GLOBAL_SCALE = ".input_global_scale"
# the layers whose global scales llmcompressor's oneshot shares, by the last part of their module's name
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: compressed-tensors' global scale of `weights` taken as one tensor (generate_gparam on their
    smallest and largest elements, in their dtype: the smallest of each one's global scale, as llmcompressor
    shares them)."""
    lo = torch.stack([w.amin() for w in weights]).amin().clamp(max=0)
    hi = torch.stack([w.amax() for w in weights]).amax().clamp(min=0)
    amax = torch.maximum(lo.abs(), hi).clamp(min=torch.finfo(hi.dtype).tiny)
    scale = torch.nan_to_num(FP8_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def quantize(weight: torch.Tensor, gscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [..., n / 2], float8 scales [..., n / 16]) of `weight` by compressed-tensors' rule with
    global scale `gscale`."""
    groups = weight.unflatten(-1, (-1, GROUP))
    amax = torch.maximum(groups.amin(-1).clamp(max=0).abs(), groups.amax(-1).clamp(min=0))
    scales = (gscale * (amax / torch.tensor(E2M1_MAX, dtype=weight.dtype))).clamp(-FP8_MAX, FP8_MAX)
    scales = scales.to(FP8).to(torch.float32)
    scales = torch.where(scales == 0, FP8_EPS, scales)
    return pack_e2m1((groups / (scales / gscale).unsqueeze(-1)).flatten(-2)), scales.to(FP8)


def shared_groups(here: frozenset[str], release: dict[str, StoredTensor] | None) -> list[frozenset[str]]:
    """The sets of quantized weights (by name) that share a global scale: the fused layers of one module (FUSED)
    whose global scales in the release are equal (every fused set, for a release whose bytes are not read)."""
    found = []
    for names in FUSED:
        fused: dict[tuple[str, ...], list[str]] = {}
        for name in sorted(here):
            parent, _, leaf = name.removesuffix(".weight").rpartition(".")
            if leaf in names and name.endswith(".weight"):
                key = (parent,) if release is None else (parent, release[name + GLOBAL].read().numpy().tobytes())
                fused.setdefault(key, []).append(name)
        found += [frozenset(members) for members in fused.values() if len(members) > 1]
    return found


@dataclass(frozen=True)
class Nvfp4Output:
    """How an nvfp4-pack-quantized output is written: which outputs are quantized (by name), the dtypes the other
    tensors take (the release's), config.json's quantization_config (the release's), the release's tensors, whose
    bytes unchanged groups keep (None: a Hub id's, every group quantized), and the weights that share a global
    scale (quantized_steps.py quantizes each such set in one step)."""

    quantized: frozenset[str]
    dtypes: dict[str, torch.dtype]
    quantization_config: dict
    release: dict[str, StoredTensor] | None = None
    shared: list[frozenset[str]] = field(default_factory=list)

    def quantizes(self, spec: OutputSpec) -> bool:
        return spec.file is None and spec.name in self.quantized and spec.rows is None

    def written_as(self, spec: OutputSpec) -> tuple[OutputSpec, ...]:
        out, cols = spec.shape
        return (OutputSpec(spec.name + PACKED, (out, cols // 2), torch.uint8),
                OutputSpec(spec.name + SCALE, (out, cols // GROUP), FP8),
                OutputSpec(spec.name + GLOBAL, (1,), torch.float32))

    def quantize(self, tensor: torch.Tensor, spec: OutputSpec) -> list[torch.Tensor]:
        return self.quantize_together({spec.name: tensor})[spec.name]

    def quantize_together(self, weights: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Each of `weights` (a set that shares one global scale, or one weight) quantized: the release's bytes
        where its values and the global scale are the release's (the module docstring)."""
        if self.release is None:
            gscale = global_scale(list(weights.values()))
            return {name: [*quantize(w, gscale), gscale] for name, w in weights.items()}
        stored = {name: [self.release[name + part].read() for part in (PACKED, SCALE, GLOBAL)] for name in weights}
        grids = {name: unchanged_blocks(as_read(nvfp4(*stored[name]), w), (1, GROUP)) for name, w in weights.items()}
        if all(grid.all() for grid in grids.values()):  # nothing changed: no quantizing
            return stored
        gscale = global_scale(list(weights.values()))
        same = all(torch.equal(gscale.view(torch.int32), s[2].view(torch.int32)) for s in stored.values())
        out = {}
        for name, w in weights.items():
            packed, scales = quantize(w, gscale)
            if same:
                packed = keep(grids[name].repeat_interleave(GROUP // 2, dim=-1), stored[name][0], packed)
                scales = keep(grids[name], stored[name][1], scales)
            out[name] = [packed, scales, gscale]
        return out

    def read_back(self, parts: list[torch.Tensor], spec: OutputSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight as merger reads `parts`, each element's bound: quantized_check.py). The bound is e2m1's half
        step times the group's scale, plus what rounding the scale to float8 may have left beyond ±6 (half a float8
        step, and 2^-7 for the scale's rounding in bfloat16 before it, times 6)."""
        packed, scales, gscale = parts
        step = scales.to(torch.float32)
        half_ulp = torch.maximum(step * E4M3_HALF_ULP, torch.tensor(E4M3_SUBNORMAL_HALF_STEP))
        bound = (E2M1_HALF_STEP * step + E2M1_MAX * (half_ulp + step * 2.0**-7)) / gscale.to(torch.float32)
        return nvfp4(packed, scales, gscale), bound.repeat_interleave(GROUP, dim=-1)


def release_layout(folder: Path, outputs: dict[str, tuple[int, ...]]) -> Nvfp4Output:
    """How to write `outputs` (name -> shape) as the nvfp4-pack-quantized release in `folder` (its scheme checked by
    config_format) stores them. A release with activations calibrated (W4A4's `input_global_scale`) is refused:
    the calibration is of data merger does not have."""
    tensors, here, dtypes = packed_release(folder, outputs, (PACKED, SCALE, GLOBAL), 2, GROUP)
    calibrated = sorted(name for name in tensors if name.endswith(INPUT_GLOBAL_SCALE))
    if calibrated:
        raise MergerError(f"compressed-tensors {NVFP4_PACK_QUANTIZED} with its activations calibrated ("
                          f"{len(calibrated)} input_global_scale, e.g. {calibrated[0]}) as {FLAG}'s release: they "
                          f"calibrate the activations on data merger does not have, and merger writes NVFP4 only "
                          f"for weights (NVFP4A16), {tensors[calibrated[0]].file or folder}")
    release = readable(tensors)
    return Nvfp4Output(here, dtypes, read_config(folder)[QUANTIZATION_CONFIG], release,
                       shared_groups(here, release))
