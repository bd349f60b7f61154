"""`--quantize fp8-block` and `--quantize mxfp8`: FP8 block-scaled output for a model with no FP8 release, as
transformers writes it: in 128x128 blocks with float32 scales (`quant_method: "fp8"`), or as transformers' `mxfp8`,
in blocks of 1x32 whose scales are powers of two stored as e8m0 bytes (`quant_method: "mxfp8"`, `scale_fmt:
"ue8m0"`, the bytes transformers' `Fp8Quantize` and ModelOpt's MXFP8 write alike: FORMATS.md).

Which modules are quantized is transformers' own default choice, asked of transformers itself: the model is built
on the meta device (no memory), its FP8 quantizer's default skips are taken (`get_modules_to_not_convert`: the
output embedding and any tied or last module, plus the class's `_keep_in_fp32_modules`), and its
`replace_with_fp8_linear` converts the rest: every plain `nn.Linear` and every fused `experts` module. Norms,
embeddings and routers are never Linear layers, so they stay as they are. A converted module's saved weights
(`<module>.weight`, or an experts module's per-expert weights) are the tensors quantized. A module
with a weight that is not whole blocks stays at --dtype, as transformers' own `Fp8Quantize` leaves such a
weight: its FP8Linear would read a partial scale grid wrongly, with no warning, so the module is added to
modules_to_not_convert, where transformers loads it as a plain Linear (an experts module whole: it has no half-FP8
form). config.json gets the quantization_config transformers writes, its skips listed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MergerError
from .fp8 import E8M0_BYTES
from .fp8_quantize import SCALE_DTYPE, Fp8Output
from .meta_model import meta_model
from .saved_names import saved_names


@dataclass(frozen=True)
class Scheme:
    """One --quantize scheme of FP8 blocks: transformers' FineGrainedFP8Config keywords and how the scales are kept."""

    block: tuple[int, int]
    ue8m0: bool
    scale_dtype: torch.dtype
    config: dict

    def transformers_config(self, **more):
        import transformers

        return transformers.FineGrainedFP8Config(weight_block_size=list(self.block), **self.config, **more)


SCHEMES = {"fp8-block": Scheme((128, 128), False, SCALE_DTYPE, {}),
           "mxfp8": Scheme((1, 32), True, E8M0_BYTES, {"quant_method": "mxfp8", "scale_fmt": "ue8m0"})}


def _transformers_choice(hf_dir: Path, config: dict, trust_remote_code: bool, name: str
                         ) -> tuple[list[str], list[str]]:
    """(the modules transformers' FP8 quantizer converts by default, the module patterns it skips)."""
    import transformers
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    archs = config.get("architectures") or []
    try:
        model = meta_model(hf_dir, config, trust_remote_code)
    except ValueError as e:
        raise MergerError(f"--quantize {name} asks transformers which modules to quantize, and it knows no class "
                          f"for this config.json (architectures {archs}, model_type {config.get('model_type')!r}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}), {hf_dir / 'config.json'}") from e
    qc = SCHEMES.get(name, SCHEMES["fp8-block"]).transformers_config()  # another --quantize: the same modules
    skip = FineGrainedFP8HfQuantizer.get_modules_to_not_convert(model, qc.modules_to_not_convert,
                                                               model._keep_in_fp32_modules)
    try:
        replace_with_fp8_linear(model, modules_to_not_convert=skip, quantization_config=qc, pre_quantized=False)
    except (AssertionError, NotImplementedError, ValueError) as e:  # a module its FP8 classes do not take
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MergerError(f"--quantize {name}: transformers {transformers.__version__} cannot make this model FP8 "
                          f"(model_type {config.get('model_type')!r}: {why}), so it could not load the output either; "
                          f"merge without --quantize, {hf_dir / 'config.json'}") from e
    return [name for name, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))], sorted(skip)


def _weights_of(module: str, outputs: dict[str, tuple[int, ...]]) -> list[str]:
    """The saved weights of a converted module: its `.weight`, or an experts module's weights of 2 dims or more
    (one per expert as checkpoints store them, or fused)."""
    if module.endswith(".experts"):
        return [n for n, shape in outputs.items() if n.startswith(module + ".") and len(shape) >= 2
                and not n.endswith("bias")]
    return [module + ".weight"] if module + ".weight" in outputs else []


def _whole_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Fp8Quantize's own test (`_quantize_one`): the last two dims are multiples of the block's."""
    return shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def default_weights(hf_dir: Path, config: dict, outputs: dict[str, tuple[int, ...]], trust_remote_code: bool,
                    name: str) -> tuple[dict[str, list[str]], list[str]]:
    """(the saved weights of each module transformers' FP8 quantizer converts by default, by the module's saved
    name; the module patterns it skips), asked for `--quantize name`."""
    modules, skip = _transformers_choice(hf_dir, config, trust_remote_code, name)
    # transformers may name a composite model's modules otherwise than it saves them (Qwen2-VL's language_model);
    # modules_to_not_convert takes saved names (transformers renames them as it loads)
    probes = [m + ".weight" for m in modules]
    renamed = saved_names(hf_dir, config, probes, trust_remote_code)
    return {m: _weights_of(m, outputs) for m in (renamed.get(p, p).removesuffix(".weight") for p in probes)}, skip


def default_layout(hf_dir: Path, config: dict, outputs: dict[str, tuple[int, ...]], trust_remote_code: bool,
                   name: str) -> tuple[Fp8Output, list[str], list[str]]:
    """How to write `outputs` as FP8 in scheme `name` (SCHEMES) in transformers' default choice, the module patterns
    it leaves out, and the weights left unquantized for not being whole blocks."""
    scheme = SCHEMES[name]
    weights, skip = default_weights(hf_dir, config, outputs, trust_remote_code, name)
    partial = sorted(m for m, ws in weights.items() if not all(_whole_blocks(outputs[w], scheme.block) for w in ws))
    quantized = frozenset(w for m, ws in weights.items() if m not in partial for w in ws)
    qc = scheme.transformers_config(modules_to_not_convert=skip + partial).to_dict()
    return (Fp8Output(scheme.block, scheme.ue8m0, quantized, {}, qc, scheme.scale_dtype), skip,
            sorted(w for m in partial for w in weights[m]))
