"""torchtitan names to HF names: one declarative table per model family.

A row is (torchtitan name, kind, HF name). Layer rows follow `layers.{i}.` and become `model.layers.{i}.`;
`{e}` in an HF name is the expert number. Kinds:
- `rename`: the tensor as it is;
- `rotary_q` / `rotary_kv`: Llama's wq / wk, whose rows are permuted from torchtitan's interleaved RoPE pairs to
  HF's rotate-half layout (by query or by key-value head count);
- `experts`: a stacked [E, ...] tensor of a MoE layer's routed experts, written as one HF tensor per expert;
- `skip`: a tensor that has no HF equivalent, left out for the reason given in its HF-name column;
- `experts_fused`: a stacked expert tensor transformers also keeps stacked on disk (gpt-oss), written whole with
  its last two dims swapped ([E, out, in] -> [E, in, out]), gate and up still interleaved as both interleave them;
- `q_lora_norm`: MLA's query norm, renamed when the layer has q-LoRA (`wq_a`); without it torchtitan still
  builds a 1-element placeholder, which HF has no place for.
Qwen3 (CosSinRoPE) and DeepSeek-V3 (HF's `rope_interleave`) need no permutation. Both naming generations of
torchtitan are accepted: `attention.wq` / `output` (<= 0.2) and `attention.qkv_linear.wq` / `lm_head` (0.3).
"""
from __future__ import annotations

GLOBAL = (
    ("tok_embeddings.weight", "rename", "model.embed_tokens.weight"),
    ("norm.weight", "rename", "model.norm.weight"),
    ("output.weight", "rename", "lm_head.weight"),
    ("lm_head.weight", "rename", "lm_head.weight"),
)
NORMS = (
    ("attention_norm.weight", "rename", "input_layernorm.weight"),
    ("ffn_norm.weight", "rename", "post_attention_layernorm.weight"),
)


def _gqa(q_kind: str, kv_kind: str) -> tuple:
    rows = []
    for prefix in ("attention.", "attention.qkv_linear."):
        rows += [(f"{prefix}wq.weight", q_kind, "self_attn.q_proj.weight"),
                 (f"{prefix}wk.weight", kv_kind, "self_attn.k_proj.weight"),
                 (f"{prefix}wv.weight", "rename", "self_attn.v_proj.weight")]
    return (*rows, ("attention.wo.weight", "rename", "self_attn.o_proj.weight"))


QK_NORM = (
    ("attention.q_norm.weight", "rename", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "rename", "self_attn.k_norm.weight"),
)
DENSE_FFN = (
    ("feed_forward.w1.weight", "rename", "mlp.gate_proj.weight"),
    ("feed_forward.w2.weight", "rename", "mlp.down_proj.weight"),
    ("feed_forward.w3.weight", "rename", "mlp.up_proj.weight"),
)
ROUTED_EXPERTS = (
    ("moe.router.gate.weight", "rename", "mlp.gate.weight"),
    ("moe.routed_experts.inner_experts.w1_EFD", "experts", "mlp.experts.{e}.gate_proj.weight"),
    ("moe.routed_experts.inner_experts.w2_EDF", "experts", "mlp.experts.{e}.down_proj.weight"),
    ("moe.routed_experts.inner_experts.w3_EFD", "experts", "mlp.experts.{e}.up_proj.weight"),
)
SHARED_EXPERTS = (
    ("moe.shared_experts.w1.weight", "rename", "mlp.shared_experts.gate_proj.weight"),
    ("moe.shared_experts.w2.weight", "rename", "mlp.shared_experts.down_proj.weight"),
    ("moe.shared_experts.w3.weight", "rename", "mlp.shared_experts.up_proj.weight"),
)
MLA = (
    ("attention.wq.weight", "rename", "self_attn.q_proj.weight"),  # without q-LoRA
    ("attention.wq_a.weight", "rename", "self_attn.q_a_proj.weight"),
    ("attention.q_norm.weight", "q_lora_norm", "self_attn.q_a_layernorm.weight"),
    ("attention.wq_b.weight", "rename", "self_attn.q_b_proj.weight"),
    ("attention.wkv_a.weight", "rename", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attention.kv_norm.weight", "rename", "self_attn.kv_a_layernorm.weight"),
    ("attention.wkv_b.weight", "rename", "self_attn.kv_b_proj.weight"),
    ("attention.wo.weight", "rename", "self_attn.o_proj.weight"),
)

MTP = (  # torchtitan's multi-token-prediction block `mtp_layers.{j}.`, beside its transformer layer's rows
    ("enorm.weight", "rename", "enorm.weight"),
    ("hnorm.weight", "rename", "hnorm.weight"),
    ("eh_proj.weight", "rename", "eh_proj.weight"),
    ("mtp_norm.weight", "rename", "shared_head.norm.weight"),
)
MTP_SHARED = (  # global tensors every MTP layer holds again in HF, as DeepSeek-V3's checkpoints do
    ("tok_embeddings.weight", "embed_tokens.weight"),
    ("lm_head.weight", "shared_head.head.weight"),
)
MTP_FAMILIES = ("deepseek_v3",)  # MTP layer j is HF layer num_hidden_layers + j; num_nextn_predict_layers counts them

GPT_OSS = (  # attention with biases and sinks, a router with a bias, experts fused on disk as transformers keeps them
    ("attention.qkv_linear.wq.weight", "rename", "self_attn.q_proj.weight"),
    ("attention.qkv_linear.wq.bias", "rename", "self_attn.q_proj.bias"),
    ("attention.qkv_linear.wk.weight", "rename", "self_attn.k_proj.weight"),
    ("attention.qkv_linear.wk.bias", "rename", "self_attn.k_proj.bias"),
    ("attention.qkv_linear.wv.weight", "rename", "self_attn.v_proj.weight"),
    ("attention.qkv_linear.wv.bias", "rename", "self_attn.v_proj.bias"),
    ("attention.wo.weight", "rename", "self_attn.o_proj.weight"),
    ("attention.wo.bias", "rename", "self_attn.o_proj.bias"),
    ("attention.sinks", "rename", "self_attn.sinks"),
    ("moe.router.gate.weight", "rename", "mlp.router.weight"),
    ("moe.router.gate.bias", "rename", "mlp.router.bias"),
    ("moe.routed_experts.inner_experts.mlp1_weight_EGD", "experts_fused", "mlp.experts.gate_up_proj"),
    ("moe.routed_experts.inner_experts.mlp1_bias_EG", "rename", "mlp.experts.gate_up_proj_bias"),
    ("moe.routed_experts.inner_experts.mlp2_weight_EDF", "experts_fused", "mlp.experts.down_proj"),
    ("moe.routed_experts.inner_experts.mlp2_bias_ED", "rename", "mlp.experts.down_proj_bias"),
    ("moe.expert_bias_E", "skip", "GPT-OSS routes by the router's logits alone: torchtitan's load-balancing bias has "
                                  "no HF equivalent"),
)

# name -> (layer rows, the config.json model_types it writes, None: any)
FAMILIES = {
    "llama": (NORMS + _gqa("rotary_q", "rotary_kv") + DENSE_FFN, None),
    "qwen3": (NORMS + _gqa("rename", "rename") + QK_NORM + DENSE_FFN + ROUTED_EXPERTS + (
        ("moe.expert_bias_E", "skip", "Qwen3-MoE routes by scores alone: torchtitan's load-balancing bias has no HF "
                                      "equivalent"),), ("qwen3", "qwen3_moe")),
    "deepseek_v3": (NORMS + MLA + DENSE_FFN + ROUTED_EXPERTS + SHARED_EXPERTS + (
        ("moe.expert_bias_E", "rename", "mlp.gate.e_score_correction_bias"),), ("deepseek_v3", "kimi_k2")),
    "gpt_oss": (NORMS + GPT_OSS, ("gpt_oss",)),
}
# Rotary tables some torchtitan versions keep as buffers: recomputed by HF, never weights.
DROPPED_BUFFERS = ("freqs_cis", "rope.cache")
