"""torchtitan's naming (its global and multi-token-prediction rows) and the layer rows its families are made of.

Layer rows follow `layers.{i}.`. Both naming generations of torchtitan are accepted: `attention.wq` / `output`
(<= 0.2) and `attention.qkv_linear.wq` / `lm_head` (0.3). Llama's wq / wk are rotary-permuted (kinds rotary_q,
rotary_kv); Qwen3 (CosSinRoPE) and DeepSeek-V3 (HF's `rope_interleave`) need no permutation. A MoE layer's
routed experts are stacked [E, ...] tensors (kind experts). MLA's query norm is written only beside q-LoRA's
`wq_a`: without it torchtitan still builds a 1-element placeholder, which HF has no place for. torchtitan's MTP
block `mtp_layers.{j}.` holds its own rows beside its transformer layer's. Qwen3.5's rows are explained beside
them. The families that use these rows are the records of families.py.
"""
from __future__ import annotations

from .family import Row, VisionTower
from .naming import MtpNaming, Naming

NORMS = (
    Row("attention_norm.weight", "rename", ("input_layernorm.weight",)),
    Row("ffn_norm.weight", "rename", ("post_attention_layernorm.weight",)),
)


def gqa(q_kind: str, kv_kind: str) -> tuple[Row, ...]:
    """Grouped-query attention under both naming generations, wq / wk as `q_kind` / `kv_kind`."""
    rows = []
    for prefix in ("attention.", "attention.qkv_linear."):
        rows += [Row(f"{prefix}wq.weight", q_kind, ("self_attn.q_proj.weight",)),
                 Row(f"{prefix}wk.weight", kv_kind, ("self_attn.k_proj.weight",)),
                 Row(f"{prefix}wv.weight", "rename", ("self_attn.v_proj.weight",))]
    return (*rows, Row("attention.wo.weight", "rename", ("self_attn.o_proj.weight",)))


QK_NORM = (
    Row("attention.q_norm.weight", "rename", ("self_attn.q_norm.weight",)),
    Row("attention.k_norm.weight", "rename", ("self_attn.k_norm.weight",)),
)
DENSE_FFN = (
    Row("feed_forward.w1.weight", "rename", ("mlp.gate_proj.weight",)),
    Row("feed_forward.w2.weight", "rename", ("mlp.down_proj.weight",)),
    Row("feed_forward.w3.weight", "rename", ("mlp.up_proj.weight",)),
)
ROUTED_EXPERTS = (
    Row("moe.router.gate.weight", "rename", ("mlp.gate.weight",)),
    Row("moe.routed_experts.inner_experts.w1_EFD", "experts", ("mlp.experts.{e}.gate_proj.weight",)),
    Row("moe.routed_experts.inner_experts.w2_EDF", "experts", ("mlp.experts.{e}.down_proj.weight",)),
    Row("moe.routed_experts.inner_experts.w3_EFD", "experts", ("mlp.experts.{e}.up_proj.weight",)),
)
SHARED_EXPERTS = (
    Row("moe.shared_experts.w1.weight", "rename", ("mlp.shared_experts.gate_proj.weight",)),
    Row("moe.shared_experts.w2.weight", "rename", ("mlp.shared_experts.down_proj.weight",)),
    Row("moe.shared_experts.w3.weight", "rename", ("mlp.shared_experts.up_proj.weight",)),
)
MLA = (
    Row("attention.wq.weight", "rename", ("self_attn.q_proj.weight",)),  # without q-LoRA
    Row("attention.wq_a.weight", "rename", ("self_attn.q_a_proj.weight",)),
    Row("attention.q_norm.weight", "rename", ("self_attn.q_a_layernorm.weight",), only_with="attention.wq_a.weight",
        reason="a placeholder torchtitan builds without q-LoRA"),
    Row("attention.wq_b.weight", "rename", ("self_attn.q_b_proj.weight",)),
    Row("attention.wkv_a.weight", "rename", ("self_attn.kv_a_proj_with_mqa.weight",)),
    Row("attention.kv_norm.weight", "rename", ("self_attn.kv_a_layernorm.weight",)),
    Row("attention.wkv_b.weight", "rename", ("self_attn.kv_b_proj.weight",)),
    Row("attention.wo.weight", "rename", ("self_attn.o_proj.weight",)),
)
GPT_OSS = (  # attention with biases and sinks, a router with a bias, experts fused on disk as transformers keeps them
    Row("attention.qkv_linear.wq.weight", "rename", ("self_attn.q_proj.weight",)),
    Row("attention.qkv_linear.wq.bias", "rename", ("self_attn.q_proj.bias",)),
    Row("attention.qkv_linear.wk.weight", "rename", ("self_attn.k_proj.weight",)),
    Row("attention.qkv_linear.wk.bias", "rename", ("self_attn.k_proj.bias",)),
    Row("attention.qkv_linear.wv.weight", "rename", ("self_attn.v_proj.weight",)),
    Row("attention.qkv_linear.wv.bias", "rename", ("self_attn.v_proj.bias",)),
    Row("attention.wo.weight", "rename", ("self_attn.o_proj.weight",)),
    Row("attention.wo.bias", "rename", ("self_attn.o_proj.bias",)),
    Row("attention.sinks", "rename", ("self_attn.sinks",)),
    Row("moe.router.gate.weight", "rename", ("mlp.router.weight",)),
    Row("moe.router.gate.bias", "rename", ("mlp.router.bias",)),
    Row("moe.routed_experts.inner_experts.mlp1_weight_EGD", "experts_fused", ("mlp.experts.gate_up_proj",)),
    Row("moe.routed_experts.inner_experts.mlp1_bias_EG", "rename", ("mlp.experts.gate_up_proj_bias",)),
    Row("moe.routed_experts.inner_experts.mlp2_weight_EDF", "experts_fused", ("mlp.experts.down_proj",)),
    Row("moe.routed_experts.inner_experts.mlp2_bias_ED", "rename", ("mlp.experts.down_proj_bias",)),
    Row("moe.expert_bias_E", "skip", reason="GPT-OSS routes by the router's logits alone: torchtitan's "
                                            "load-balancing bias has no HF equivalent"),
)
# Qwen3.5 (torchtitan's qwen3_5): every layer's mixer is `attn.`, either gated full attention (wq holds each
# head's query then its gate, as HF's q_proj does; q/k norms weigh 1 + w on both sides) or a Gated DeltaNet, whose
# separate q, k, v projections and conv channels HF fuses (kind cat). The gated norm weighs w on both sides.
QWEN3_5_ATTENTION = (
    Row("attn.wq.weight", "rename", ("self_attn.q_proj.weight",)),
    Row("attn.wk.weight", "rename", ("self_attn.k_proj.weight",)),
    Row("attn.wv.weight", "rename", ("self_attn.v_proj.weight",)),
    Row("attn.wo.weight", "rename", ("self_attn.o_proj.weight",)),
    Row("attn.q_norm.weight", "rename", ("self_attn.q_norm.weight",)),
    Row("attn.k_norm.weight", "rename", ("self_attn.k_norm.weight",)),
)
GATED_DELTANET = (
    Row("attn.in_proj_q.weight", "cat", ("linear_attn.in_proj_qkv.weight",),
        joined=("attn.in_proj_k.weight", "attn.in_proj_v.weight")),
    Row("attn.in_proj_z.weight", "rename", ("linear_attn.in_proj_z.weight",)),
    Row("attn.in_proj_b.weight", "rename", ("linear_attn.in_proj_b.weight",)),
    Row("attn.in_proj_a.weight", "rename", ("linear_attn.in_proj_a.weight",)),
    Row("attn.conv_q.weight", "cat", ("linear_attn.conv1d.weight",),
        joined=("attn.conv_k.weight", "attn.conv_v.weight")),
    Row("attn.A_log", "rename", ("linear_attn.A_log",)),
    Row("attn.dt_bias", "rename", ("linear_attn.dt_bias",)),
    Row("attn.norm.weight", "rename", ("linear_attn.norm.weight",)),
    Row("attn.out_proj.weight", "rename", ("linear_attn.out_proj.weight",)),
)
QWEN3_5_MOE = ROUTED_EXPERTS + (  # and one shared expert behind a sigmoid gate
    Row("moe.shared_experts.w1.weight", "rename", ("mlp.shared_expert.gate_proj.weight",)),
    Row("moe.shared_experts.w2.weight", "rename", ("mlp.shared_expert.down_proj.weight",)),
    Row("moe.shared_experts.w3.weight", "rename", ("mlp.shared_expert.up_proj.weight",)),
    Row("moe.shared_experts.gate.weight", "rename", ("mlp.shared_expert_gate.weight",)),
    Row("moe.expert_bias_E", "skip", reason="Qwen3.5-MoE routes by scores alone: torchtitan's load-balancing bias "
                                            "has no HF equivalent"),
)
# torchtitan's Qwen3.5 always builds its vision tower, and Kimi-K2.5 / K2.7 may hold one: the text model written
# alone (config.json the text model's) has no place for it
VISION_TOWER = (("vision_encoder.", "the vision tower, which the HF text model has no place for"),)
# Qwen3.5's vision tower, where config.json is the VLM's (qwen3_5, qwen3_5_moe): blocks with separate q, k, v
# (weights and biases) HF fuses as qkv, the patch embedding a Linear HF keeps as a Conv3d
QWEN3_5_VISION = VisionTower(
    ("qwen3_5", "qwen3_5_moe"), "vision_encoder.", "vision_encoder.layers.", "model.visual.blocks.{i}.", globals=(
        Row("vision_encoder.patch_embed.weight", "patch_conv3d", ("model.visual.patch_embed.proj.weight",)),
        Row("vision_encoder.patch_embed.bias", "rename", ("model.visual.patch_embed.proj.bias",)),
        Row("vision_encoder.pos_embed", "rename", ("model.visual.pos_embed.weight",)),
        *(Row(f"vision_encoder.merger.{m}.{p}", "rename", (f"model.visual.merger.{m}.{p}",))
          for m in ("norm", "linear_fc1", "linear_fc2") for p in ("weight", "bias")),
    ),
    rows=(
        *(Row(f"{m}.{p}", "rename", (f"{m}.{p}",))
          for m in ("norm1", "norm2", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2") for p in ("weight", "bias")),
        *(Row(f"attn.wq.{p}", "cat", (f"attn.qkv.{p}",), joined=(f"attn.wk.{p}", f"attn.wv.{p}"))
          for p in ("weight", "bias")),
    ),
    text_prefixes=(("model.", "model.language_model."),))
# Kimi-K2.5 / K2.7's MoonViT tower and projector, where config.json is the VLM's (kimi_k25), under the names of
# Moonshot's release, which torchtitan's own to_hf writes and transformers' kimi_k25 converts on load: q, k, v
# (weights and biases) fused as wqkv in torchtitan's rotary layout (adjacent pairs; transformers permutes them for
# its own on load), the patch embedding a Linear HF keeps as a Conv2d, the text model under `language_model.`
KIMI_K25_VISION = VisionTower(
    ("kimi_k25",), "vision_encoder.", "vision_encoder.layers.", "vision_tower.encoder.blocks.{i}.", globals=(
        Row("vision_encoder.patch_embed.weight", "patch_conv2d", ("vision_tower.patch_embed.proj.weight",)),
        Row("vision_encoder.patch_embed.bias", "rename", ("vision_tower.patch_embed.proj.bias",)),
        Row("vision_encoder.pos_embed", "rename", ("vision_tower.patch_embed.pos_emb.weight",)),
        *(Row(f"vision_encoder.{m}.{p}", "rename", (f"{hf}.{p}",)) for m, hf in (
            ("final_norm", "vision_tower.encoder.final_layernorm"), ("projector.pre_norm", "mm_projector.pre_norm"),
            ("projector.linear_1", "mm_projector.proj.0"), ("projector.linear_2", "mm_projector.proj.2"))
          for p in ("weight", "bias")),
    ),
    rows=(
        *(Row(f"{m}.{p}", "rename", (f"{hf}.{p}",)) for m, hf in (
            ("norm1", "norm0"), ("norm2", "norm1"), ("attn.proj", "wo"), ("mlp.linear_fc1", "mlp.fc0"),
            ("mlp.linear_fc2", "mlp.fc1")) for p in ("weight", "bias")),
        *(Row(f"attn.wq.{p}", "cat", (f"wqkv.{p}",), joined=(f"attn.wk.{p}", f"attn.wv.{p}"))
          for p in ("weight", "bias")),
    ),
    text_prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")))

TORCHTITAN = Naming(
    "torchtitan", "layers.",
    globals=(
        Row("tok_embeddings.weight", "rename", ("model.embed_tokens.weight",)),
        Row("norm.weight", "rename", ("model.norm.weight",)),
        Row("output.weight", "rename", ("lm_head.weight",)),
        Row("lm_head.weight", "rename", ("lm_head.weight",)),
    ),
    mtp=MtpNaming(
        "mtp_layers.", ("",),  # its transformer layer's rows sit beside its own
        rows=(
            Row("enorm.weight", "rename", ("enorm.weight",)),
            Row("hnorm.weight", "rename", ("hnorm.weight",)),
            Row("eh_proj.weight", "rename", ("eh_proj.weight",)),
            Row("mtp_norm.weight", "rename", ("shared_head.norm.weight",)),
        ),
        shared=(
            Row("tok_embeddings.weight", "rename", ("embed_tokens.weight",)),
            Row("lm_head.weight", "rename", ("shared_head.head.weight",)),
        ),
    ),
)
# Rotary tables some torchtitan versions keep as buffers: recomputed by HF, never weights.
DROPPED_BUFFERS = ("freqs_cis", "rope.cache")
