"""Megatron's naming (its global and multi-token-prediction rows) and the layer rows its families are made of.

Layer rows follow `decoder.layers.{i}.` (`{e}` is the global expert number). Both local-spec and TE names appear
(`input_layernorm.weight` or `linear_qkv.layer_norm_weight`), since the layer spec decides which one a
checkpoint holds. An MTP layer (`mtp.layers.{j}.`) holds its own rows, its transformer layer
(`transformer_layer.`, Megatron-Bridge's `mtp_model_layer.`) with the family's layer rows, and writes the shared
embedding and output layer again as that layer's `embed_tokens` and `shared_head.head`. The families that use
these rows are the records of families.py.
"""
from __future__ import annotations

from .family import Row, VisionTower
from .naming import MtpNaming, Naming

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

ATTENTION = (
    Row("input_layernorm.weight", "rename", ("input_layernorm.weight",)),
    Row("self_attention.linear_qkv.layer_norm_weight", "rename", ("input_layernorm.weight",)),
    Row("self_attention.linear_qkv.weight", "qkv", tuple(f"{p}.weight" for p in QKV)),
    Row("self_attention.linear_qkv.bias", "qkv", tuple(f"{p}.bias" for p in QKV)),
    Row("self_attention.linear_proj.weight", "rename", ("self_attn.o_proj.weight",)),
    Row("pre_mlp_layernorm.weight", "rename", ("post_attention_layernorm.weight",)),
    Row("mlp.linear_fc1.layer_norm_weight", "rename", ("post_attention_layernorm.weight",)),
)
QK_NORM = (
    Row("self_attention.q_layernorm.weight", "rename", ("self_attn.q_norm.weight",)),
    Row("self_attention.k_layernorm.weight", "rename", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    Row("mlp.linear_fc1.weight", "gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    Row("mlp.linear_fc2.weight", "rename", ("mlp.down_proj.weight",)),
)
ROUTED_EXPERTS = (
    Row("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    Row("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("mlp.experts.{e}.down_proj.weight",)),
)
EXPERTS = (Row("mlp.router.weight", "rename", ("mlp.gate.weight",)),) + ROUTED_EXPERTS


def shared_experts(hf: str) -> tuple[Row, ...]:
    """Megatron's shared experts (one gated MLP) as HF's MLP named `hf`."""
    return (Row("mlp.shared_experts.linear_fc1.weight", "gate_up", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")),
            Row("mlp.shared_experts.linear_fc2.weight", "rename", (f"{hf}.down_proj.weight",)))


SHARED_EXPERT = shared_experts("mlp.shared_expert") + (
    Row("mlp.shared_experts.gate_weight", "rename", ("mlp.shared_expert_gate.weight",)),)
MIXTRAL_EXPERTS = (  # the hub's names, which transformers converts to its fused layout on load
    Row("mlp.router.weight", "rename", ("block_sparse_moe.gate.weight",)),
    Row("mlp.experts.local_experts.{e}.linear_fc1.weight", "gate_up",
        ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight")),
    Row("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("block_sparse_moe.experts.{e}.w2.weight",)),
)
MLA = (  # multi-latent attention, with q-LoRA (q_down/q_up) or without (q_proj); TE fuses the norms
    Row("input_layernorm.weight", "rename", ("input_layernorm.weight",)),
    Row("self_attention.linear_q_proj.layer_norm_weight", "rename", ("input_layernorm.weight",)),
    Row("self_attention.linear_q_proj.weight", "rename", ("self_attn.q_proj.weight",)),
    Row("self_attention.linear_q_down_proj.weight", "rename", ("self_attn.q_a_proj.weight",)),
    Row("self_attention.q_layernorm.weight", "rename", ("self_attn.q_a_layernorm.weight",)),
    Row("self_attention.linear_q_up_proj.layer_norm_weight", "rename", ("self_attn.q_a_layernorm.weight",)),
    Row("self_attention.linear_q_up_proj.weight", "rename", ("self_attn.q_b_proj.weight",)),
    Row("self_attention.linear_kv_down_proj.weight", "rename", ("self_attn.kv_a_proj_with_mqa.weight",)),
    Row("self_attention.kv_layernorm.weight", "rename", ("self_attn.kv_a_layernorm.weight",)),
    Row("self_attention.linear_kv_up_proj.layer_norm_weight", "rename", ("self_attn.kv_a_layernorm.weight",)),
    Row("self_attention.linear_kv_up_proj.weight", "rename", ("self_attn.kv_b_proj.weight",)),
    Row("self_attention.linear_proj.weight", "rename", ("self_attn.o_proj.weight",)),
    Row("pre_mlp_layernorm.weight", "rename", ("post_attention_layernorm.weight",)),
    Row("mlp.linear_fc1.layer_norm_weight", "rename", ("post_attention_layernorm.weight",)),
)
INDEXER = "self_attention.core_attention.indexer."
DSA_INDEXER = tuple(  # DeepSeek Sparse Attention's lightning indexer, beside MLA (DeepSeek-V3.2, GLM-5)
    Row(f"{INDEXER}{megatron}", "rename", (f"self_attn.indexer.{hf}",))
    for megatron, hf in (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
                         ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                         ("linear_weights_proj.weight", "weights_proj.weight")))
BIASED_EXPERTS = EXPERTS + (  # a sigmoid router whose expert bias steers the choice
    Row("mlp.router.expert_bias", "rename", ("mlp.gate.e_score_correction_bias",)),)
DEEPSEEK_MOE = BIASED_EXPERTS + shared_experts("mlp.shared_experts")
# ERNIE-4.5-MoE: a softmax router beside its moe_statics correction bias (0 from Megatron: kinds.py), shared experts
ERNIE_MOE = (Row("mlp.router.weight", "router_zero_bias", ("mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias")),
             ) + ROUTED_EXPERTS + shared_experts("mlp.shared_experts")
# Hunyuan v3: DeepSeek-V3's MoE under the release's names (transformers renames them on load and back on save)
HY_V3_MOE = (
    Row("mlp.router.weight", "rename", ("mlp.router.gate.weight",)),
    Row("mlp.router.expert_bias", "rename", ("mlp.expert_bias",)),
) + ROUTED_EXPERTS + shared_experts("mlp.shared_mlp")
# MiMo-V2-Flash: attention whose key-value heads differ by layer type (the fused QKV split by its layer's own: kinds.py's
# layer_qkv), sinks on the sliding-window layers (saved as the release names them, transformers' `sinks` on load), a
# dense first layer then DeepSeek-V3's sigmoid router with its expert bias, routed experts and no shared expert
MIMO_V2_FLASH = tuple(Row(r.source, "layer_qkv", r.targets) if r.kind == "qkv" else r for r in ATTENTION) + (
    Row("self_attention.core_attention.softmax_offset", "rename", ("self_attn.attention_sink_bias",)),
) + DENSE_MLP + BIASED_EXPERTS
# Nemotron-H (MambaModel): each layer is one norm and one mixer, a Mamba2 mixer, attention, an MLP (relu2, not
# gated) or a MoE by the hybrid pattern; HF keeps each as `norm` and `mixer.*`. TE fuses the norm into the mixer's first
# linear. in_proj and conv1d are the whole tensors HF has ([z; x; B; C; dt], [x; B; C]: sources/megatron_sections.py).
NEMOTRON_H = tuple(Row(source, "rename", (target,)) for source, target in (
    ("norm.weight", "norm.weight"),
    ("mixer.in_proj.layer_norm_weight", "norm.weight"),
    *((f"mixer.{name}", f"mixer.{name}") for name in (
        "in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")),
    ("input_layernorm.weight", "norm.weight"),
    ("self_attention.linear_qkv.layer_norm_weight", "norm.weight"),
    ("self_attention.linear_proj.weight", "mixer.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "norm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "norm.weight"),
    ("mlp.linear_fc1.weight", "mixer.up_proj.weight"),
    ("mlp.linear_fc2.weight", "mixer.down_proj.weight"),
    ("mlp.router.weight", "mixer.gate.weight"),
    ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", "mixer.experts.{e}.up_proj.weight"),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "mixer.experts.{e}.down_proj.weight"),
    ("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
    ("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight"),
)) + (Row("self_attention.linear_qkv.weight", "qkv", tuple(f"mixer.{p.split('.')[1]}.weight" for p in QKV)),)
GPT_OSS = (  # attention with biases and sinks, a router with a bias, experts with biases stacked as HF keeps them
    Row("self_attention.linear_proj.bias", "rename", ("self_attn.o_proj.bias",)),
    Row("self_attention.core_attention.softmax_offset", "rename", ("self_attn.sinks",)),
    Row("mlp.router.weight", "rename", ("mlp.router.weight",)),
    Row("mlp.router.bias", "rename", ("mlp.router.bias",)),
    Row("mlp.experts.local_experts.{e}.linear_fc1.weight", "experts_gate_up_interleaved",
        ("mlp.experts.gate_up_proj",), stacked=True),
    Row("mlp.experts.local_experts.{e}.linear_fc1.bias", "gate_up_interleaved", ("mlp.experts.gate_up_proj_bias",),
        stacked=True),
    Row("mlp.experts.local_experts.{e}.linear_fc2.weight", "experts_fused", ("mlp.experts.down_proj",), stacked=True),
    Row("mlp.experts.local_experts.{e}.linear_fc2.bias", "rename", ("mlp.experts.down_proj_bias",), stacked=True),
)
MINIMAX_M2_MOE = MIXTRAL_EXPERTS + (  # Mixtral's expert names, with DeepSeek-V3's expert bias steering the choice
    Row("mlp.router.expert_bias", "rename", ("block_sparse_moe.e_score_correction_bias",)),
)

# Qwen3-Next / Qwen3.5 full attention: an output gate per query head fused into linear_qkv, q/k norms
GATED_ATTENTION = tuple(r for r in ATTENTION if r.kind != "qkv") + QK_NORM + (
    Row("self_attention.linear_qkv.weight", "gated_qkv", tuple(f"{p}.weight" for p in QKV)),)


def gated_deltanet(in_proj_kind: str, in_proj: tuple[str, ...]) -> tuple[Row, ...]:
    """A Gated DeltaNet layer (megatron-core GatedDeltaNet as `self_attention`), its input projection written as
    `in_proj_kind` into HF's `in_proj` tensors (after `linear_attn.`); TE fuses the input norm into in_proj."""
    return (
        Row("self_attention.in_proj.layer_norm_weight", "rename", ("input_layernorm.weight",)),
        Row("self_attention.in_proj.weight", in_proj_kind, tuple(f"linear_attn.{t}.weight" for t in in_proj)),
        Row("self_attention.conv1d.weight", "rename", ("linear_attn.conv1d.weight",)),
        Row("self_attention.A_log", "rename", ("linear_attn.A_log",)),
        Row("self_attention.dt_bias", "rename", ("linear_attn.dt_bias",)),
        Row("self_attention.out_norm.weight", "zero_centred_norm", ("linear_attn.norm.weight",)),
        Row("self_attention.out_proj.weight", "rename", ("linear_attn.out_proj.weight",)),
    )


# what tells a Gated DeltaNet hybrid's layers apart, by config.json's layer_types names
DELTANET_LAYER_TYPES = {"linear_attention": "self_attention.in_proj.weight",
                        "full_attention": "self_attention.linear_qkv.weight"}


def _biased(rows: tuple[tuple[str, str], ...]) -> tuple[Row, ...]:
    """Renames (source module, HF module) of modules with a weight and a bias."""
    return tuple(Row(f"{m}.{p}", "rename", (f"{hf}.{p}",)) for m, hf in rows for p in ("weight", "bias"))


# Qwen3-VL's vision tower as Megatron-Bridge's Qwen3VLModel saves it (`vision_model.`, the text model as
# `language_model.`), written whole where config.json is the HF VLM's (qwen3_vl, qwen3_vl_moe; Qwen3.5's qwen3_5 and
# qwen3_5_moe, whose tower the bridge saves in the same module, without deepstack mergers). Its blocks are
# megatron-core TransformerLayers with LayerNorms (TE's names fused into linear_qkv / linear_fc1, or the local spec's own), a
# query group per head (linear_qkv per head [q; k; v], HF's qkv [q; k; v]), biased linears; its patch merger and
# deepstack mergers (`patch_norm`, fc1, fc2) are HF's `norm`, fc1, fc2; the patch embedding is HF's Conv3d.
_MERGER = _biased((("patch_norm", "norm"), ("linear_fc1", "linear_fc1"), ("linear_fc2", "linear_fc2")))


def qwen3_vl_vision(model_types: tuple[str, ...], deepstack: bool = True) -> VisionTower:
    """Qwen3-VL's tower, the same in the dense VLM and the MoE one; Qwen3.5's without its deepstack mergers, which
    HF's Qwen3.5 tower has no place for."""
    return VisionTower(
        model_types, "vision_model.", "vision_model.decoder.layers.", "model.visual.blocks.{i}.",
        globals=(*_biased((("vision_model.patch_embed.proj", "model.visual.patch_embed.proj"),)),
                 Row("vision_model.pos_embed.weight", "rename", ("model.visual.pos_embed.weight",)),
                 *(Row(f"vision_model.merger.{r.source}", "rename", (f"model.visual.merger.{r.targets[0]}",))
                   for r in _MERGER)),
        rows=(*_biased((("self_attention.linear_proj", "attn.proj"), ("mlp.linear_fc1", "mlp.linear_fc1"),
                        ("mlp.linear_fc2", "mlp.linear_fc2"), ("input_layernorm", "norm1"),
                        ("pre_mlp_layernorm", "norm2"))),
              *(Row(f"{m}.layer_norm_{p}", "rename", (f"{hf}.{p}",))
                for m, hf in (("self_attention.linear_qkv", "norm1"), ("mlp.linear_fc1", "norm2"))
                for p in ("weight", "bias")),
              *(Row(f"self_attention.linear_qkv.{p}", "vision_qkv", (f"attn.qkv.{p}",)) for p in ("weight", "bias"))),
        text_prefixes=(("model.", "model.language_model."),),
        lists=(("vision_model.decoder.deepstack_merger_list.", "model.visual.deepstack_merger_list.{i}.",
                _MERGER),) if deepstack else ())


def _as_is(prefix: str, hf: str, names: tuple[str, ...]) -> tuple[Row, ...]:
    return tuple(Row(f"{prefix}{n}", "rename", (f"{hf}{n}",)) for n in names)


# GLM-4.5V's vision tower as Megatron-Bridge's GLM45VModel saves it: HF's own module as `visual.` (its names, whole
# on every TP rank: sources/megatron_tp.py), the text model as `language_model.`; HF keeps it as `model.visual.`.
# Every name is listed, so a tensor HF has no place for is refused rather than written.
GLM4V_VISION = VisionTower(
    ("glm4v_moe",), "visual.", "visual.blocks.", "model.visual.blocks.{i}.",
    globals=_as_is("visual.", "model.visual.", (
        "patch_embed.proj.weight", "patch_embed.proj.bias", "post_conv_layernorm.weight",
        "embeddings.position_embedding.weight", "post_layernorm.weight", "downsample.weight", "downsample.bias",
        "merger.proj.weight", "merger.post_projection_norm.weight", "merger.post_projection_norm.bias",
        "merger.gate_proj.weight", "merger.up_proj.weight", "merger.down_proj.weight")),
    rows=_as_is("", "", ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")),
    text_prefixes=(("model.", "model.language_model."),))


# Qwen3-VL-MoE's experts: transformers keeps them stacked on disk, gate_up_proj [E, 2F, D] (each expert's
# cat(gate, up), Megatron's fc1 as it is) and down_proj [E, D, F]
QWEN3_VL_MOE_EXPERTS = (
    Row("mlp.router.weight", "rename", ("mlp.gate.weight",)),
    Row("mlp.experts.local_experts.{e}.linear_fc1.weight", "rename", ("mlp.experts.gate_up_proj",), stacked=True),
    Row("mlp.experts.local_experts.{e}.linear_fc2.weight", "rename", ("mlp.experts.down_proj",), stacked=True),
)

MEGATRON = Naming(
    "Megatron", "decoder.layers.",
    globals=(
        Row("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)),
        Row("decoder.final_layernorm.weight", "rename", ("model.norm.weight",)),
        Row("decoder.final_norm.weight", "rename", ("model.norm.weight",)),  # MambaStack's
        Row("output_layer.weight", "vocab", ("lm_head.weight",)),
    ),
    mtp=MtpNaming(
        "mtp.layers.", ("transformer_layer.", "mtp_model_layer."),
        rows=(
            Row("enorm.weight", "rename", ("enorm.weight",)),
            Row("hnorm.weight", "rename", ("hnorm.weight",)),
            Row("eh_proj.weight", "rename", ("eh_proj.weight",)),
            Row("final_layernorm.weight", "rename", ("shared_head.norm.weight",)),
        ),
        shared=(
            Row("embedding.word_embeddings.weight", "vocab", ("embed_tokens.weight",)),
            Row("output_layer.weight", "vocab", ("shared_head.head.weight",)),
        ),
        tied_source="embedding.word_embeddings.weight",  # tied: no output layer, the embedding is the head
    ),
)
