"""Megatron names to HF names: one declarative table per model family.

A row is (Megatron suffix, kind, HF names): the suffix follows `decoder.layers.{i}.` for layer rows
(`{e}` is the global expert number), kind says which transform applies (rename, qkv, gate_up, vocab; see
megatron.py). Adding a family is adding a table. Both local-spec and TE names appear
(`input_layernorm.weight` or `linear_qkv.layer_norm_weight`), since the layer spec decides which one a
checkpoint holds.

Multi-token-prediction layers (`mtp.layers.{j}.`, DeepSeek-V3) become HF layers `model.layers.{L + j}.` after
the L decoder layers, as DeepSeek-V3's checkpoints hold them: the MTP layer's own rows (MTP), its transformer
layer through the family's layer rows, and the shared embedding and output layer written again as that layer's
`embed_tokens` and `shared_head.head` (MTP_SHARED). Only the families in MTP_FAMILIES have MTP layers in HF.
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

MLA = (  # multi-latent attention, with q-LoRA (q_down/q_up) or without (q_proj); TE fuses the norms
    ("input_layernorm.weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_q_proj.layer_norm_weight", "rename", ("input_layernorm.weight",)),
    ("self_attention.linear_q_proj.weight", "rename", ("self_attn.q_proj.weight",)),
    ("self_attention.linear_q_down_proj.weight", "rename", ("self_attn.q_a_proj.weight",)),
    ("self_attention.q_layernorm.weight", "rename", ("self_attn.q_a_layernorm.weight",)),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "rename", ("self_attn.q_a_layernorm.weight",)),
    ("self_attention.linear_q_up_proj.weight", "rename", ("self_attn.q_b_proj.weight",)),
    ("self_attention.linear_kv_down_proj.weight", "rename", ("self_attn.kv_a_proj_with_mqa.weight",)),
    ("self_attention.kv_layernorm.weight", "rename", ("self_attn.kv_a_layernorm.weight",)),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "rename", ("self_attn.kv_a_layernorm.weight",)),
    ("self_attention.linear_kv_up_proj.weight", "rename", ("self_attn.kv_b_proj.weight",)),
    ("self_attention.linear_proj.weight", "rename", ("self_attn.o_proj.weight",)),
    ("pre_mlp_layernorm.weight", "rename", ("post_attention_layernorm.weight",)),
    ("mlp.linear_fc1.layer_norm_weight", "rename", ("post_attention_layernorm.weight",)),
)
DEEPSEEK_MOE = EXPERTS + (  # a sigmoid router whose expert bias steers the choice, and shared experts
    ("mlp.router.expert_bias", "rename", ("mlp.gate.e_score_correction_bias",)),
    ("mlp.shared_experts.linear_fc1.weight", "gate_up",
     ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    ("mlp.shared_experts.linear_fc2.weight", "rename", ("mlp.shared_experts.down_proj.weight",)),
)
MTP = (  # after `mtp.layers.{j}.`; its transformer layer (`transformer_layer.`, Megatron-Bridge's
         # `mtp_model_layer.`) takes the family's layer rows
    ("enorm.weight", "rename", ("enorm.weight",)),
    ("hnorm.weight", "rename", ("hnorm.weight",)),
    ("eh_proj.weight", "rename", ("eh_proj.weight",)),
    ("final_layernorm.weight", "rename", ("shared_head.norm.weight",)),
)
MTP_TRANSFORMER_LAYER = ("transformer_layer", "mtp_model_layer")
MTP_SHARED = (  # global tensors every MTP layer holds again; without an output layer (tied) the embedding
    ("embedding.word_embeddings.weight", "vocab", ("embed_tokens.weight",)),
    ("output_layer.weight", "vocab", ("shared_head.head.weight",)),
)
# Row counts config.json fixes for tensors a TP layout could leave ambiguous (TE keeps MLA's down
# projections whole on every rank, the local spec splits them).
CONFIG_ROWS = {
    "self_attn.q_a_proj.weight": lambda c: c["q_lora_rank"],
    "self_attn.kv_a_proj_with_mqa.weight": lambda c: c["kv_lora_rank"] + c["qk_rope_head_dim"],
}

FAMILIES = {
    "llama": ATTENTION + DENSE_MLP,
    "mistral": ATTENTION + DENSE_MLP,
    "qwen2": ATTENTION + DENSE_MLP,
    "qwen3": ATTENTION + QK_NORM + DENSE_MLP,
    "qwen2_moe": ATTENTION + DENSE_MLP + EXPERTS + SHARED_EXPERT,  # dense rows for mlp_only_layers
    "mixtral": ATTENTION + MIXTRAL_EXPERTS,
    "qwen3_moe": ATTENTION + QK_NORM + DENSE_MLP + EXPERTS,
    "deepseek_v3": MLA + DENSE_MLP + DEEPSEEK_MOE,  # dense rows for the first_k_dense_replace layers
}
MTP_FAMILIES = ("deepseek_v3",)  # config.json's num_nextn_predict_layers counts them
