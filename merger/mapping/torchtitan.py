"""torchtitan checkpoints (the DCP folders torchtitan and verl's torchtitan engine save) to HF names, through the
model family's table (torchtitan_families.py).

The family is found from the names (MLA's `wkv_a`: deepseek_v3; a query norm in GQA: qwen3; else llama), or
`--model torchtitan-<family>` says it. A MoE layer's routed experts are stacked tensors ([E, F, D]); each
expert's part is read on its own (sources/unstacked.py) and written under the per-expert names transformers
saves. Llama's wq / wk are rotary-permuted: torchtitan (like Meta's original Llama) applies rotary embeddings to
adjacent pairs of each head's channels, HF's Llama rotates the first half of a head against the second half,
so the same model in HF stores the rows of q_proj / k_proj permuted within each head (row 2i goes to row i and
row 2i+1 to row i + head_dim/2). The head counts and the architecture come from the HF config, which a
torchtitan checkpoint lacks: pass `--hf_model_config_path` with the config.json of the HF model to produce.
"""
from __future__ import annotations

import re
from functools import partial

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from ..sources.unstacked import unstacked
from .hf import model_config
from .steps import Mapping, OutputSpec, Step, cast
from .torchtitan_families import DROPPED_BUFFERS, FAMILIES, GLOBAL, MTP, MTP_FAMILIES, MTP_SHARED

MODELS = {f"torchtitan-{family.replace('_', '-')}": family for family in FAMILIES}  # the --model values
_LAYER = r"layers\.(?P<i>\d+)\."
_MTP_LAYER = r"mtp_layers\.(?P<j>\d+)\."


def looks_like_torchtitan(names) -> bool:
    return any(n == "tok_embeddings.weight" or re.fullmatch(r"layers\.\d+\.attention\.(qkv_linear\.)?wq\.weight", n)
               for n in names)


def family_of(names) -> str:
    """The family whose names these are: gpt-oss's fused experts, MLA's wkv_a, then a GQA query norm, tell them
    apart."""
    if any(re.fullmatch(_LAYER + r"moe\.routed_experts\.inner_experts\.mlp1_weight_EGD", n) for n in names):
        return "gpt_oss"
    if any(re.fullmatch(_LAYER + r"attention\.wkv_a\.weight", n) for n in names):
        return "deepseek_v3"
    if any(re.fullmatch(_LAYER + r"attention\.q_norm\.weight", n) for n in names):
        return "qwen3"
    return "llama"


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """The names look like torchtitan's, or --model names a torchtitan family."""
    if options.model == "auto":
        return looks_like_torchtitan(catalog.tensors)
    return options.model in MODELS


def _compile(rows) -> list[tuple[re.Pattern, str, str]]:
    """Global rows, then each layer row for decoder layers and for MTP layers (`j`: numbered after them)."""
    table = [(re.compile(re.escape(src)), kind, dst) for src, kind, dst in GLOBAL]
    for layer in (_LAYER, _MTP_LAYER):
        table += [(re.compile(layer + re.escape(src)), kind, dst if kind == "skip" else "model.layers.{i}." + dst)
                  for src, kind, dst in (rows if layer == _LAYER else rows + MTP)]
    return table


def _mtp_layers(catalog: Catalog, family: str, config: dict, options: MergeOptions) -> list[int]:
    """The MTP layers to write: none with --drop-mtp; an error for a family HF has no MTP layers for, or when
    config.json's layer count would misnumber them."""
    names = [n for n in catalog.tensors if n.startswith("mtp_layers.")]
    if not names or options.drop_mtp:
        return []
    if family not in MTP_FAMILIES:
        raise MergerError(f"torchtitan tensor {names[0]} belongs to a multi-token-prediction layer, which the {family} "
                          f"family has no HF names for (pass --drop-mtp to leave MTP layers out), {catalog.root}")
    decoder = {n.split(".")[1] for n in catalog.tensors if n.startswith("layers.")}
    if len(decoder) != config.get("num_hidden_layers"):
        raise MergerError(f"the checkpoint has {len(decoder)} decoder layers but config.json's num_hidden_layers is "
                          f"{config.get('num_hidden_layers')}, so its MTP layers would be misnumbered, {catalog.root}")
    return sorted({int(n.split(".")[1]) for n in names})


def rotary_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads * head_dim, in] with pairs (2i, 2i+1) per head -> halves (i, i + head_dim/2) per head."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _swap_last_dims(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[0].transpose(-2, -1)]


def _permute_step(n_heads: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [rotary_permute(tensors[0], n_heads)]


def _head_counts(config: dict) -> dict[str, tuple[int, int]]:
    """Per permutation kind: (heads, head_dim) from the HF config."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as e:
        raise MergerError(f"config.json has no {e} (a torchtitan Llama needs the HF Llama config of the model, "
                          f"--hf_model_config_path)") from e
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {"q": (heads, head_dim), "kv": (kv_heads, head_dim)}


def _checked_config(family: str, config: dict, hf_dir) -> None:
    wanted = FAMILIES[family][1]
    if wanted is not None and config.get("model_type") not in wanted:
        raise MergerError(f"torchtitan {family} names, but config.json has model_type {config.get('model_type')!r} "
                          f"(expected {' or '.join(wanted)}): pass the HF config of this model with "
                          f"--hf_model_config_path, {hf_dir / 'config.json'}")


def _rotary_step(name: str, out: str, shape: tuple, dtype: torch.dtype, heads: tuple[int, int], root) -> Step:
    n, head_dim = heads
    if len(shape) != 2 or shape[0] != n * head_dim or head_dim % 2:
        raise MergerError(f"tensor {name} is {shape} but config.json gives {n} heads of dim {head_dim} "
                          f"(pass the HF config of this model with --hf_model_config_path), {root}")
    return Step((name,), (OutputSpec(out, shape, dtype),), partial(_permute_step, n))


def _mtp_shared(catalog: Catalog, config: dict, mtp: list[int]) -> list[Step]:
    """HF's MTP layer holds the shared embedding and output layer again, as DeepSeek-V3's checkpoints do."""
    return [cast(src, f"model.layers.{config['num_hidden_layers'] + j}.{dst}", catalog.tensors[src].shape,
                 catalog.tensors[src].dtype) for j in mtp for src, dst in MTP_SHARED if src in catalog.tensors]


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    family = MODELS.get(options.model) or family_of(catalog.tensors)
    hf_dir, config = model_config(catalog, options)
    _checked_config(family, config, hf_dir)
    table = _compile(FAMILIES[family][0])
    mtp = _mtp_layers(catalog, family, config, options)
    steps, stacks, skipped = [], {}, []
    for name, t in catalog.tensors.items():
        if any(name == b or name.endswith("." + b) for b in DROPPED_BUFFERS):
            continue  # recomputed by HF, never a weight
        if name.startswith("mtp_layers.") and not mtp:
            continue  # --drop-mtp
        match = next(((kind, dst, m) for pattern, kind, dst in table if (m := pattern.fullmatch(name))), None)
        if match is None:
            raise MergerError(f"tensor {name} has no HF name in torchtitan's {family} table (is this a torchtitan "
                              f"{family} checkpoint? --model names the family), {catalog.root}")
        kind, dst, m = match
        layer = m.groupdict().get("i")
        if m.groupdict().get("j") is not None:
            layer = config["num_hidden_layers"] + int(m["j"])
        if kind == "q_lora_norm" and name.replace("q_norm.weight", "wq_a.weight") not in catalog.tensors:
            kind, dst = "skip", "a placeholder torchtitan builds without q-LoRA"
        if kind == "skip":
            skipped.append(f"{name} ({dst})")
            continue
        out = dst.format(i=layer, e="{e}")
        if kind == "experts":
            stacks[name] = partial("{}.{}".format, name)
            steps += [cast(stacks[name](e), out.format(e=e), t.shape[1:], t.dtype) for e in range(t.shape[0])]
        elif kind == "experts_fused":
            steps.append(Step((name,), (OutputSpec(out, (*t.shape[:-2], t.shape[-1], t.shape[-2]), t.dtype),),
                              _swap_last_dims))
        elif kind in ("rotary_q", "rotary_kv"):
            steps.append(_rotary_step(name, out, t.shape, t.dtype, _head_counts(config)[kind[len("rotary_"):]],
                                      catalog.root))
        else:  # rename, q_lora_norm
            steps.append(cast(name, out, t.shape, t.dtype))
    steps += _mtp_shared(catalog, config, mtp)
    note = f"merger: torchtitan {family} names, written as HF {config.get('model_type')}"
    if stacks:
        note += f"; {len(stacks)} stacked expert tensors split per expert"
    if mtp:
        note += f"; {len(mtp)} MTP layers written after the decoder layers"
    elif options.drop_mtp and any(n.startswith("mtp_layers.") for n in catalog.tensors):
        note += "; MTP layers left out (--drop-mtp)"
    if skipped:
        note += f"; left out: {', '.join(skipped)}"
    updates = {"num_nextn_predict_layers": len(mtp)} if family in MTP_FAMILIES else {}
    return Mapping(steps, hf_dir, config, config_updates=updates, notes=(note,),
                   catalog=unstacked(catalog, stacks) if stacks else None)
