"""Which Megatron tensors tensor parallelism splits, and along which dim, known by the ends of their names.

The split belongs to megatron-core's module classes, the same in every model family: ColumnParallelLinear and
VocabParallelEmbedding split dim 0, RowParallelLinear dim 1, norms, routers and gates are whole on every rank.
A legacy checkpoint's catalog needs it before config.json says which family the model is, so it lives here, below
the mapping, rather than in the family records; the records (mapping/families.py) are checked against it when
imported, so a family row naming a tensor whose split is not known here fails then, instead of one rank's shard
being read as the whole tensor.
"""
from __future__ import annotations

from typing import Container

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_up_proj.weight", "eh_proj.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
# Gated DeltaNet (megatron-core ssm/gated_delta_net.py): in_proj column-parallel and out_proj row-parallel; conv1d's
# channels and the per-value-head A_log and dt_bias are split with the heads (megatron_sections.py places in_proj
# and conv1d section by section)
GDN_COLUMN = ("self_attention.in_proj.weight", "self_attention.conv1d.weight", "self_attention.conv1d.bias",
              "self_attention.A_log", "self_attention.dt_bias")
GDN_ROW = ("self_attention.out_proj.weight",)
# MLA's down projections: column-parallel in the local spec, whole on every rank in TE's (a TELinear, with the
# q/kv norms fused into the up projections, so `linear_kv_up_proj.layer_norm_weight` marks a TE layer).
MLA_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
WHOLE = ("norm.weight", "layer_norm_weight", "router.weight", "router.expert_bias", "gate_weight")


def split_known(name: str) -> bool:
    return name.endswith(COLUMN + ROW + GDN_COLUMN + GDN_ROW + MLA_DOWN + WHOLE)


def tp_dim(name: str, shape: tuple[int, ...], held: Container[str]) -> int | None:
    """The dim tensor `name` (of `shape` on one rank) is split along over TP (or expert TP) ranks, None: whole on
    every rank; `held` are the names its rank file holds beside it."""
    if name == "output_layer.weight" and shape[:1] == (1,):
        return None  # a critic's value head: a replicated Linear(hidden, 1), not a vocab-parallel layer
    if name.endswith(MLA_DOWN):
        fused_norm = name.rsplit(".", 2)[0] + ".linear_kv_up_proj.layer_norm_weight"
        return None if fused_norm in held else 0
    return 0 if name.endswith(COLUMN + GDN_COLUMN) else 1 if name.endswith(ROW + GDN_ROW) else None
