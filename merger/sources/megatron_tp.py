"""Which Megatron tensors tensor parallelism splits, and along which dim, known by the ends of their names.

The split belongs to megatron-core's module classes, the same in every model family: ColumnParallelLinear and
VocabParallelEmbedding split dim 0, RowParallelLinear dim 1 (its bias is whole), norms, routers and gates are
whole on every rank. A legacy checkpoint's catalog needs it before config.json says which family the model is, so
it lives here, below the mapping, rather than in the family records; the records (mapping/families.py) are
checked against it when imported, so a family row naming a tensor whose split is not known here fails then,
instead of one rank's shard being read as the whole tensor.

Two splits carry no `tensor_model_parallel` flag, so the name alone says them: attention sinks
(`core_attention.softmax_offset`, gpt-oss's learnable softmax offset: one per query head, the rank's heads), and
a q/k norm as wide as all the rank's heads (MiniMax-M2 normalises q and k across every head, so its norms hold
heads x head_dim, split as the heads are) rather than one head's (Qwen3's, GLM-4.5's: whole on every rank).
"""
from __future__ import annotations

from typing import Mapping

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_up_proj.weight", "eh_proj.weight", "core_attention.softmax_offset")
# A Mamba2 mixer splits its heads: in_proj and conv1d section by section (megatron_sections.py), the per-head
# vectors, and its gated norm (ExtendedRMSNorm, split along dim 0 although a norm); out_proj is row-parallel.
MAMBA = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.A_log", "mixer.D", "mixer.dt_bias",
         "mixer.norm.weight")
# Gated DeltaNet (megatron-core ssm/gated_delta_net.py) splits its value heads the same way: in_proj and conv1d
# section by section, A_log and dt_bias with the heads; out_proj is row-parallel.
GATED_DELTANET = ("self_attention.in_proj.weight", "self_attention.conv1d.weight", "self_attention.conv1d.bias",
                  "self_attention.A_log", "self_attention.dt_bias")
ROW = ("linear_proj.weight", "linear_fc2.weight", "mixer.out_proj.weight", "self_attention.out_proj.weight")
# MLA's down projections: column-parallel in the local MLA spec, whole on every rank in TE's (a duplicated
# TELinear) and in DeepSeek Sparse Attention's (TE's TELinear or the local backend's replicated Linear, with the
# q/kv norms unfused): _mla_down_dim tells them apart.
MLA_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
QK_NORMS = ("q_layernorm.weight", "k_layernorm.weight")
# DeepSeek Sparse Attention's indexer (core_attention.indexer.*): replicated Linears and a LayerNorm on every rank
DSA_INDEXER = ("indexer.linear_wq_b.weight", "indexer.linear_wk.weight", "indexer.linear_weights_proj.weight",
               "indexer.k_norm.bias")
# A ViT's (Qwen3-VL's tower: LayerNorms with biases, a patch embedding Conv3d and a position embedding, none split)
VIT_WHOLE = ("norm.bias", "layer_norm_bias", "patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight")
# A vision tower kept as HF's own module (Megatron-Bridge's GLM-4.5V: `visual.*`, HF's names): not a megatron-core
# module, so TP never splits it and every rank holds it whole, whatever its names end with
HF_MODULE_PREFIXES = ("visual.",)
WHOLE = ("norm.weight", "layer_norm_weight", "router.weight", "router.bias", "router.expert_bias", "gate_weight",
         "linear_proj.bias", "linear_fc2.bias") + DSA_INDEXER + VIT_WHOLE


def split_known(name: str) -> bool:
    return name.startswith(HF_MODULE_PREFIXES) or name.endswith(COLUMN + MAMBA + GATED_DELTANET + ROW + MLA_DOWN + WHOLE)


def _full_width_qk_norm(name: str, held: Mapping[str, tuple[int, ...]]) -> bool:
    """True where the attention's q and k norms together are as wide as its fused qkv rows (q + 2 k: the rank's
    query heads, its key heads and its value heads, as wide as each other). One head's norms (q = k = head_dim)
    fit that only where the rank holds one query and one key-value head; with q = k both readings fit, and the
    norm is read as one head's (a full-width one then fails the mapping's row count check against config.json)."""
    attention = name.rsplit(".", 2)[0]
    q, k, qkv = (held.get(f"{attention}.{n}") for n in (*QK_NORMS, "linear_qkv.weight"))
    return bool(q and k and qkv) and q[0] != k[0] and q[0] + 2 * k[0] == qkv[0]


def _mla_down_dim(name: str, held: Mapping[str, tuple[int, ...]]) -> int | None:
    """0 where the rank holds its share of MLA's down projections' rows, None where it holds them whole. The q down
    projection is whole where its rows are as many as the q up projection's input columns (the q-LoRA rank: a
    column-parallel layer never splits its input), a share of them where split (fewer, by TP; at TP 1 both read the
    same). Every megatron-core spec builds both down projections from one kind of linear, so the kv one follows
    the q one. Without q-LoRA (no q down projection; DSA's indexer needs one) TE's fused kv norm
    (`linear_kv_up_proj.layer_norm_weight`) marks the whole kv down projection of TE's MLA spec."""
    attention = name.rsplit(".", 2)[0]
    q_down, q_up = (held.get(f"{attention}.linear_q_{n}_proj.weight") for n in ("down", "up"))
    if q_down and q_up:
        return None if q_down[0] == q_up[1] else 0
    return None if f"{attention}.linear_kv_up_proj.layer_norm_weight" in held else 0


def tp_dim(name: str, shape: tuple[int, ...], held: Mapping[str, tuple[int, ...]]) -> int | None:
    """The dim tensor `name` (of `shape` on one rank) is split along over TP (or expert TP) ranks, None: whole on
    every rank; `held` are the names its rank file holds beside it, with their shapes on that rank."""
    if name.startswith(HF_MODULE_PREFIXES):
        return None
    if name == "output_layer.weight" and shape[:1] == (1,):
        return None  # a critic's value head: a replicated Linear(hidden, 1), not a vocab-parallel layer
    if name.endswith(MLA_DOWN):
        return _mla_down_dim(name, held)
    if name.endswith(QK_NORMS):
        return 0 if _full_width_qk_norm(name, held) else None
    return 0 if name.endswith(COLUMN + MAMBA + GATED_DELTANET) else 1 if name.endswith(ROW) else None
