"""torchtitan Llama tensor names to HF Llama names, with the rotary permutation of wq / wk HF expects.

torchtitan (like Meta's original Llama) applies rotary embeddings to adjacent pairs of each head's
channels; HF's Llama rotates the first half of a head against the second half. The same model in HF
therefore stores the rows of q_proj / k_proj permuted within each head: row 2i goes to row i and row 2i+1
to row i + head_dim/2. The head counts come from the HF config, which a torchtitan checkpoint lacks:
pass `--hf_model_config_path` with the config.json of the HF model to produce.

Both naming generations are accepted: `attention.wq` / `output` (torchtitan <= 0.2) and
`attention.qkv_linear.wq` / `lm_head` (0.3).
"""
from __future__ import annotations

import re
from functools import partial

import torch

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from .hf import model_config
from .steps import Mapping, OutputSpec, Step, cast

MODEL_NAME = "torchtitan-llama"

# (pattern on the torchtitan name, HF name template, which head count permutes it: None, "q" or "kv")
_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight", None),
    (r"norm\.weight", "model.norm.weight", None),
    (r"(?:output|lm_head)\.weight", "lm_head.weight", None),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight", "model.layers.{}.self_attn.q_proj.weight", "q"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight", "model.layers.{}.self_attn.k_proj.weight", "kv"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight", "model.layers.{}.self_attn.v_proj.weight", None),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{}.self_attn.o_proj.weight", None),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{}.mlp.gate_proj.weight", None),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{}.mlp.down_proj.weight", None),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{}.mlp.up_proj.weight", None),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{}.input_layernorm.weight", None),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight", None),
]
# Rotary tables some torchtitan versions keep as buffers: recomputed by HF, never weights.
_DROPPED = re.compile(r"(.*\.)?(freqs_cis|rope\.cache)")


def looks_like_torchtitan(names) -> bool:
    return any(n == "tok_embeddings.weight" or re.fullmatch(r"layers\.\d+\.attention\.(qkv_linear\.)?wq\.weight", n)
               for n in names)


def claims(catalog: Catalog, options: MergeOptions) -> bool:
    """The names look like torchtitan's, or --model says so."""
    if options.model == "auto":
        return looks_like_torchtitan(catalog.tensors)
    return options.model == MODEL_NAME


def hf_name(name: str) -> tuple[str, str | None] | None:
    """(HF name, permutation kind) for a torchtitan name; None for a rotary table to drop."""
    if _DROPPED.fullmatch(name):
        return None
    for pattern, template, kind in _NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups()), kind
    raise MergerError(f"tensor {name} has no HF Llama name (is this a torchtitan Llama checkpoint?)")


def rotary_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads * head_dim, in] with pairs (2i, 2i+1) per head -> halves (i, i + head_dim/2) per head."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


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


def build(catalog: Catalog, options: MergeOptions) -> Mapping:
    hf_dir, config = model_config(catalog, options)
    heads = _head_counts(config)
    steps = []
    for name, t in catalog.tensors.items():
        mapped = hf_name(name)
        if mapped is None:
            continue
        out, kind = mapped
        if kind is None:
            steps.append(cast(name, out, t.shape, t.dtype))
            continue
        n, head_dim = heads[kind]
        if len(t.shape) != 2 or t.shape[0] != n * head_dim or head_dim % 2:
            raise MergerError(f"tensor {name} is {t.shape} but config.json gives {n} heads of dim {head_dim} "
                              f"(pass the HF config of this model with --hf_model_config_path), {catalog.root}")
        steps.append(Step((name,), (OutputSpec(out, t.shape, t.dtype),), partial(_permute_step, n)))
    return Mapping(steps, hf_dir, config)
