"""The tie and dtype policy, applied once to every mapper's steps.

Tied embeddings: a model whose config ties its output embedding to its input embedding (transformers' rule, or
--tie_word_embedding) is written with `lm_head.weight` left out, as save_pretrained writes it; a mapping that
unties them (a LoRA adapter that changed one side) says so with `tie_word_embeddings: false` among its config
updates, and then both are written. When the source holds both tensors, the config alone does not decide: the
left-out step is kept in `Mapping.tie`, and the merge compares the two tensors' values before the plan is fixed
(engine/tie_check.py), writing both when they differ. Dtype: every model tensor that is floating point takes
--dtype (`keep`: its own), as save_pretrained writes a model loaded at that dtype: the modules the model's class
keeps in float32 at that dtype (DeepSeek-V3's router `gate.weight` and `e_score_correction_bias` at bfloat16)
are written in float32, holding the source's values exactly where it stores them in float32. Side files (an
adapter folder's weights) keep the dtype their mapper declared. Quantized output (`--quantize_like`, `--quantize`):
the tensors the release (or transformers' default FP8 choice, or gpt-oss's experts for MXFP4) quantizes are then
quantized from that dtype (quantized_steps.py); with a release, the others take its dtypes.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import MergerError
from ..hf_folder import read_config
from ..io import location
from ..options import MergeOptions
from . import (compressed_tensors_default, int4_release_layout, modelopt_scheme, mxfp4_layout,
               mxfp4_pack_release_layout, mxfp8_release_layout, nvfp4_release_layout)
from .compressed_tensors_scheme import COMPRESSED_TENSORS
from .fp8_default_modules import default_layout
from .fp8_release_layout import release_layout
from .int4_release_layout import PACK_QUANTIZED, Int4Output
from .keep_in_fp32 import keep_in_fp32
from .modelopt_scheme import MODELOPT, MODELOPT_CONFIG
from .mxfp4_pack_release_layout import MXFP4_PACK_QUANTIZED, Mxfp4PackOutput
from .mxfp4_quantize import Mxfp4Output
from .mxfp8_release_layout import MXFP8_QUANTIZED, Mxfp8Output
from .nvfp4_release_layout import MODELOPT_NVFP4, NVFP4_PACK_QUANTIZED, Nvfp4Output
from .quantized_formats import MXFP4, QUANTIZATION_CONFIG, config_format
from .quantized_steps import quantize_steps, quantized_count
from .steps import FLOAT8, Mapping, OutputSpec, Step, Tie, output_dtype

TIED_OUTPUT = "lm_head.weight"
PARTIAL_NAMED = 5  # the log names the first few weights left unquantized for partial blocks: a model has one per layer
# Names of the input embedding in common HF architectures: the tensor a tied lm_head shares.
INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def ties_embeddings(config: dict) -> bool:
    """transformers' rule: a top-level flag, else the text config's; PretrainedConfig defaults it to True."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", True))


def ties(config: dict, options: MergeOptions) -> bool:
    """Whether the model ties its embeddings, as the checkpoint's config or --tie_word_embedding says."""
    return options.tie_word_embedding or ties_embeddings(config)


def input_embedding(names) -> str | None:
    for suffix in INPUT_EMBEDDINGS:
        for name in names:
            if name.endswith(suffix):
                return name
    return None


def _keeps_fp32(spec: OutputSpec, fp32: re.Pattern | None) -> bool:
    return (fp32 is not None and spec.file is None and spec.dtype.is_floating_point and spec.dtype not in FLOAT8
            and fp32.search(spec.name) is not None)


def _cast(spec: OutputSpec, wanted: torch.dtype | None, fp32: re.Pattern | None) -> OutputSpec:
    if spec.file is not None:
        return spec
    if _keeps_fp32(spec, fp32):
        return dataclasses.replace(spec, dtype=torch.float32)
    return dataclasses.replace(spec, dtype=output_dtype(spec.dtype, wanted))


def _fp32_pattern(config: dict, wanted: torch.dtype | None) -> re.Pattern | None:
    """transformers' matching of its keep-in-fp32 list: each entry a regular expression (`*` for any run of
    characters) searched in the tensor's name (core_model_loading's build_glob_alternation)."""
    patterns = keep_in_fp32(config, wanted)
    return re.compile("|".join(p.replace("*", ".*") for p in patterns)) if patterns else None


def _refuse_scaleless_float8(steps: list[Step], wanted: torch.dtype | None, config_dir) -> None:
    """A float8 tensor cast to another dtype would lose its scale: only a dequantizing mapping may change it."""
    for step in steps:
        spec = step.outputs[0]
        if step.is_cast and spec.file is None and spec.dtype in FLOAT8 and wanted not in (None, spec.dtype):
            raise MergerError(f"tensor {spec.name} is stored as {str(spec.dtype).removeprefix('torch.')}, and a cast "
                              f"to {str(wanted).removeprefix('torch.')} without its scales would change its values "
                              f"(merger dequantizes FP8 only as config.json's quantization_config describes it: "
                              f"quant_method fp8 with weight_block_size; --dtype keep copies it as it is), "
                              f"{config_dir / 'config.json' if config_dir else 'config.json'}")


def _tie(steps: list[Step]) -> Tie | None:
    """The step writing lm_head.weight and the input embedding it would be tied to; None when the mapping writes
    no lm_head, or nothing else (a lone lm_head is all there is)."""
    head = [s for s in steps if [(o.name, o.file) for o in s.outputs] == [(TIED_OUTPUT, None)]]
    if not head or sum(o.file is None for s in steps for o in s.outputs) == 1:
        return None
    return Tie(head[0], input_embedding(o.name for s in steps for o in s.outputs if o.file is None))


def apply_policy(mapping: Mapping, options: MergeOptions) -> Mapping:
    """`mapping` with the tied output left out (in `tie`) and every model tensor in the output dtype."""
    tied = ties(mapping.config, options) and mapping.config_updates.get("tie_word_embeddings") is not False
    wanted = options.torch_dtype
    _refuse_scaleless_float8(mapping.steps, wanted, mapping.hf_dir)
    fp32 = _fp32_pattern(mapping.config, wanted) if mapping.hf_dir is not None else None
    steps = [Step(s.inputs, tuple(_cast(o, wanted, fp32) for o in s.outputs), s.transform) for s in mapping.steps]
    mapping = dataclasses.replace(mapping, steps=steps)
    if mapping.quantize_like is not None and options.dtype == "keep" and options.quantize is None:
        options = dataclasses.replace(options, quantize_like=options.quantize_like or mapping.quantize_like)
    if mapping.hf_dir is not None and (options.quantize_like is not None or options.quantize is not None):
        mapping = _quantized(mapping, options)
    kept = sorted({o.name for s in mapping.steps for o in s.outputs  # a tensor written in slabs, once
                   if _keeps_fp32(o, fp32) and o.dtype == torch.float32})  # a release may store them otherwise
    if kept:
        note = (f"merger: {len(kept)} tensors written in float32, as transformers keeps "
                f"{fp32.pattern.replace('|', ', ')} in float32 at {str(wanted).removeprefix('torch.')} "
                f"(e.g. {kept[0]})")
        mapping = dataclasses.replace(mapping, notes=(*mapping.notes, note))
    tie = _tie(mapping.steps) if tied else None
    if tie is not None:
        mapping = dataclasses.replace(mapping, steps=[s for s in mapping.steps if s is not tie.step])
    return dataclasses.replace(mapping, tie=tie)


def _layout(mapping: Mapping, options: MergeOptions, outputs: dict[str, tuple[int, ...]]):
    """(the quantized layout, how the log names it, what it leaves out, what is done to config.json's
    quantization_config, the log's lines on weights left unquantized for not being whole blocks): --quantize_like's
    release (FP8, gpt-oss MXFP4, compressed-tensors' INT4, MXFP4 or NVFP4, compressed-tensors' or ModelOpt's MXFP8), or
    --quantize's scheme."""
    if options.quantize_like is not None:
        folder = location(options.quantize_like)  # a folder, a Hub snapshot's, or a bucket's
        # a format merger does not write is refused here; a release with none, by the FP8 layout's own check
        config = read_config(folder)
        stored = config_format(folder, config)
        written = config[QUANTIZATION_CONFIG]["format"] if stored == COMPRESSED_TENSORS else None
        if written == PACK_QUANTIZED:
            layout = int4_release_layout.release_layout(folder, outputs)
        elif written == MXFP4_PACK_QUANTIZED:
            layout = mxfp4_pack_release_layout.release_layout(folder, outputs)
        elif written == NVFP4_PACK_QUANTIZED:
            layout = nvfp4_release_layout.release_layout(folder, outputs)
        elif written == MXFP8_QUANTIZED:
            layout = mxfp8_release_layout.release_layout(folder, outputs, "compressed-tensors",
                                                         mxfp8_release_layout.compressed_tensors_quantize)
        elif stored == MODELOPT:
            layout = _modelopt_layout(folder, config, outputs)
        else:
            layout = (mxfp4_layout.release_layout if stored == MXFP4 else release_layout)(folder, outputs)
        return layout, f"like {options.quantize_like}", "", "copied into", ()
    if options.quantize == mxfp4_layout.SCHEME:
        layout = mxfp4_layout.default_layout(mapping.hf_dir, mapping.config, outputs)
        return (layout, f"({options.quantize}, gpt-oss's experts)", "; left unquantized: every other tensor "
                "(attention, router, embeddings, norms, lm_head, the experts' biases), as the gpt-oss release",
                "written into", ())
    at = str(options.torch_dtype).removeprefix('torch.')
    if options.quantize in compressed_tensors_default.SCHEMES:
        layout, skip, partial = compressed_tensors_default.default_layout(
            mapping.hf_dir, mapping.config, outputs, options.trust_remote_code, options.quantize, options.torch_dtype)
        which = "the routed experts" if options.quantize == "int4" else "transformers' Linear layers"
        left = (f"; left unquantized: {', '.join(skip)} (transformers' default skips)"
                f"{', every other Linear layer' if options.quantize == 'int4' else ''} and every module that is not "
                f"a Linear layer (embeddings, norms, routers)")
        why = (f"whole groups of {compressed_tensors_default.GROUPS[options.quantize]} along the last dim (a "
               f"2-dim weight in whole groups is what compressed-tensors' readers take; an experts module with one "
               f"such weight whole), their modules in the quantization_config's ignore")
        return layout, f"({options.quantize}, {which})", left, "written into", _partial_note(partial, at, why)
    layout, skip, partial = default_layout(mapping.hf_dir, mapping.config, outputs, options.trust_remote_code,
                                           options.quantize)
    left = (f"; left unquantized: {', '.join(skip)} (transformers' default skips) and every module that is not "
            f"a Linear layer or experts (embeddings, norms, routers)")
    why = (f"whole {layout.block[0]}x{layout.block[1]} blocks (transformers' Fp8Quantize quantizes only whole "
           f"blocks), their modules in modules_to_not_convert")
    return (layout, f"({options.quantize}, transformers' default choice of modules)", left, "written into",
            _partial_note(partial, at, why))


def _partial_note(partial: list[str], dtype: str, why: str) -> tuple[str, ...]:
    """The log's line on weights left unquantized for not being whole blocks or groups (a line of its own: these
    are Linear layers a reader expects quantized)."""
    if not partial:
        return ()
    return (f"merger: {len(partial)} tensors left at {dtype}, not {why}: {', '.join(partial[:PARTIAL_NAMED])}"
            f"{', ...' if len(partial) > PARTIAL_NAMED else ''}",)


def _modelopt_layout(folder, config: dict, outputs: dict[str, tuple[int, ...]]) -> Mxfp8Output | Nvfp4Output:
    """--quantize_like a ModelOpt export, MXFP8 or NVFP4 (the algorithms config_format lets through), in its format
    (mxfp8_release_layout.py, nvfp4_release_layout.py); one with its KV cache quantized is refused."""
    described, _, said = modelopt_scheme.described(folder, config)
    algo = described["quant_algo"]
    if described.get("kv_cache_quant_algo") is not None:
        raise MergerError(f"ModelOpt {algo} with its KV cache quantized ({described['kv_cache_quant_algo']}) as "
                          f"--quantize_like's release: its k_scale and v_scale calibrate the cache on data merger "
                          f"does not have, and merger writes such an export only without them, {said}")
    files = (MODELOPT_CONFIG,) if (folder / MODELOPT_CONFIG).is_file() else ()
    if algo == MODELOPT_NVFP4:
        return nvfp4_release_layout.release_layout(folder, outputs, nvfp4_release_layout.MODELOPT, files)
    return mxfp8_release_layout.release_layout(folder, outputs, "ModelOpt", mxfp8_release_layout.modelopt_quantize,
                                               files)


def _format(layout) -> tuple[str, str]:
    """(the format's name, how its tensors are stored), for the log."""
    if isinstance(layout, Mxfp4Output):
        return "MXFP4", "uint8 _blocks of e2m1 pairs, uint8 _scales e8m0 per 32 elements"
    if isinstance(layout, Int4Output):
        return "compressed-tensors INT4", (f"int32 weight_packed of 8 codes, {str(layout.scale_dtype).removeprefix('torch.')}"
                                           f" weight_scale per 32 elements, int64 weight_shape")
    if isinstance(layout, Mxfp4PackOutput):
        return "compressed-tensors MXFP4", "uint8 weight_packed of 2 e2m1 codes, uint8 (e8m0) weight_scale per 32 elements"
    if isinstance(layout, Nvfp4Output):
        codes, scale, shared = layout.producer.parts
        calibration = (f", float32 {layout.producer.calibration.lstrip('.')} the release's"
                       if layout.calibrated else "")
        return f"{layout.producer.name} NVFP4", (f"uint8 weight{codes} of 2 e2m1 codes, float8_e4m3fn weight{scale} "
                                                 f"per 16 elements, float32 weight{shared}{calibration}")
    if isinstance(layout, Mxfp8Output):
        return f"{layout.producer} MXFP8", "float8_e4m3fn weight, uint8 (e8m0) weight_scale per 32 elements"
    scales = {torch.uint8: "uint8 (e8m0)", torch.float8_e8m0fnu: "float8_e8m0fnu"}.get(layout.scale_dtype, "float32")
    fp4 = (f"; the experts FP4, {str(layout.fp4_pairs).removeprefix('torch.')} pairs of e2m1 codes, block 1x32"
           if layout.fp4 else "")
    return "FP8", (f"float8_e4m3fn, block {layout.block[0]}x{layout.block[1]}, weight_scale_inv {scales}"
                   f"{', scale_fmt ue8m0' if layout.ue8m0 else ''}{fp4}")


def _kept_blocks(layout, name: str) -> str:
    """What --quantize_like does with the blocks training left unchanged (release_blocks.py)."""
    if layout.release is None:
        return (f"merger: every {name} block quantized again: only the release's headers were read (a Hub id), so "
                f"its bytes cannot be kept where nothing changed; a local copy of the release keeps them")
    shared = ""
    if isinstance(layout, Nvfp4Output):
        shared = (f", where its global scale is the release's too ({len(layout.shared)} sets of layers share one, "
                  f"as the release does: one whose weights changed and whose global scale then differs is "
                  f"quantized whole)")
    return (f"merger: each {name} block whose values are the release's own keeps the release's bytes (codes and "
            f"scale){shared}; every other block is quantized")


def _quantized(mapping: Mapping, options: MergeOptions) -> Mapping:
    """`mapping` written quantized: in the layout of --quantize_like's release, or --quantize's scheme (FP8 in
    transformers' default choice of modules, MXFP4 for gpt-oss's experts); config.json gets the
    quantization_config."""
    outputs = {o.name: o.shape for s in mapping.steps for o in s.outputs if o.file is None}
    if options.quantize_like is not None and options.quantize is not None:
        raise MergerError(f"--quantize_like and --quantize both say how to quantize: pass one, "
                          f"{options.quantize_like}")
    layout, how, left, config, partial = _layout(mapping, options, outputs)
    name, stored = _format(layout)
    if options.torch_dtype == torch.float16:  # float16 would turn weights beyond ±65504 into inf before the scale
        raise MergerError(f"{name} output is quantized from the weights at --dtype, and float16 cannot hold every "
                          f"weight: use --dtype bfloat16 (the default) or float32, "
                          f"{options.quantize_like or mapping.hf_dir}")
    count = quantized_count(mapping.steps, layout)
    notes = (f"merger: {count} tensors written as {name} {how} ({stored}){left}; {QUANTIZATION_CONFIG} {config} "
             f"config.json",)
    # a ModelOpt export's hf_quant_config.json
    files = layout.files if isinstance(layout, (Mxfp8Output, Nvfp4Output)) else {}
    if files:
        notes = (f"{notes[0]}, {', '.join(files)} beside it",)
    notes += partial
    if options.quantize_like is not None:
        notes += (_kept_blocks(layout, name),)
    steps = quantize_steps(mapping.steps, layout, checked_as=name if options.verify else None)
    return dataclasses.replace(mapping, steps=steps, notes=(*mapping.notes, *notes),
                               extra_files={**mapping.extra_files, **files},
                               config_updates={**mapping.config_updates,
                                               QUANTIZATION_CONFIG: layout.quantization_config},
                               config_removals=tuple(k for k in mapping.config_removals if k != QUANTIZATION_CONFIG))
