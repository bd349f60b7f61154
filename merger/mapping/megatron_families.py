"""Megatron names to HF names: one declarative table per model family.

A row is (Megatron suffix, kind, HF names): the suffix follows `decoder.layers.{i}.` for layer rows
(`{e}` is the global expert number), kind says which transform applies (rename, qkv, gate_up, vocab; see
megatron.py). Adding a family is adding a table. Both local-spec and TE names appear
(`input_layernorm.weight` or `linear_qkv.layer_norm_weight`), since the layer spec decides which one a
checkpoint holds.
"""
from __future__ import annotations

GLOBAL = (
    ("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)),
    ("decoder.final_layernorm.weight", "rename", ("model.norm.weight",)),
    ("output_layer.weight", "vocab", ("lm_head.weight",)),
)
ATTENTION = (
    ("input_layernorm.weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.layer_norm_weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
    ("self_attention.linear_qkv.bias", "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias")),
    ("self_attention.linear_proj.weight", "rename", ("self_attn.o_proj.weight",)),
    ("pre_mlp_layernorm.weight", "rename", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.layer_norm_weight", "rename", ("post_attention_layernorm.weight",)),
)
QK_NORM = (
    ("self_attention.q_layernorm.weight", "rename", ("self_attn.q_norm.weight",)),
    ("self_attention.k_layernorm.weight", "rename", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    ("mlp.linear_fc1.weight", "gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", "rename", ("mlp.down_proj.weight",)),
)
EXPERTS = (
    ("mlp.router.weight", "rename", ("mlp.gate.weight",)),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
     ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("mlp.experts.{e}.down_proj.weight",)),
)
SHARED_EXPERT = (
    ("mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    ("mlp.shared_experts.linear_fc2.weight", "rename", ("mlp.shared_expert.down_proj.weight",)),
    ("mlp.shared_experts.gate_weight", "rename", ("mlp.shared_expert_gate.weight",)),
)
MIXTRAL_EXPERTS = (  # the hub's names, which transformers converts to its fused layout on load
    ("mlp.router.weight", "rename", ("block_sparse_moe.gate.weight",)),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
     ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight")),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("block_sparse_moe.experts.{e}.w2.weight",)),
)

FAMILIES = {
    "llama": ATTENTION + DENSE_MLP,
    "mistral": ATTENTION + DENSE_MLP,
    "qwen2": ATTENTION + DENSE_MLP,
    "qwen3": ATTENTION + QK_NORM + DENSE_MLP,
    "qwen2_moe": ATTENTION + DENSE_MLP + EXPERTS + SHARED_EXPERT,  # dense rows for mlp_only_layers
    "mixtral": ATTENTION + MIXTRAL_EXPERTS,
    "qwen3_moe": ATTENTION + QK_NORM + DENSE_MLP + EXPERTS,
}
