"""The model families merger maps, one record each (family.py): adding a family is adding a record here, plus a
kind (kinds.py) only for a new transform.

The records are checked together when imported: a model type belongs to one family, every Megatron row names a
tensor whose TP split sources/megatron_tp.py knows (a legacy checkpoint is read by it before the family is known),
a torchtitan mark belongs to one family's rows, and exactly one torchtitan family has no mark (what torchtitan
names are when nothing marks them).
"""
from __future__ import annotations

from ..sources.megatron_tp import split_known
from . import megatron_rows as mr
from . import torchtitan_rows as tr
from .family import Family, MtpLayout, Row
from .kinds import head_counts

# DeepSeek-V3's MTP layers: HF layers after the decoder layers, with the embedding and output layer again
NEXTN = MtpLayout("num_nextn_predict_layers")
# Qwen3-Next's and Qwen3.5's MTP layer (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py, Megatron-Bridge's Qwen3-Next
# mapping): its transformer layer `mtp.layers.{j}.` under the decoder layer's names, its projection and norms once
# as `mtp.*` (fc: Megatron's eh_proj, the same [embedding; hidden] order; the norms zero-centred in both), the
# embedding and output layer the model's. Qwen3.5's config.json counts it as mtp_num_hidden_layers; Qwen3-Next's
# release counts it nowhere, and vLLM reads num_nextn_predict_layers.
QWEN_MTP_OWN = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head.norm.weight": "mtp.norm.weight"}


def qwen_mtp(count_key: str) -> MtpLayout:
    return MtpLayout(count_key, layer="mtp.layers.{j}.", own=QWEN_MTP_OWN, shared=False)


# TE keeps MLA's down projections whole on every rank, the local spec splits them
MLA_CONFIG_ROWS = {"self_attn.q_a_proj.weight": lambda c: c["q_lora_rank"],
                   "self_attn.kv_a_proj_with_mqa.weight": lambda c: c["kv_lora_rank"] + c["qk_rope_head_dim"]}

# q/k norms across all heads (heads x head_dim): a legacy TP file's share of them is checked against these widths
FULL_WIDTH_QK_NORMS = {"self_attn.q_norm.weight": lambda c: head_counts(c)[0] * head_counts(c)[2],
                       "self_attn.k_norm.weight": lambda c: head_counts(c)[1] * head_counts(c)[2]}

FAMILIES = (
    Family("llama", ("llama",), megatron=mr.ATTENTION + mr.DENSE_MLP,
           torchtitan=tr.NORMS + tr.gqa("rotary_q", "rotary_kv") + tr.DENSE_FFN, torchtitan_any_config=True),
    Family("mistral", ("mistral",), megatron=mr.ATTENTION + mr.DENSE_MLP),
    Family("qwen2", ("qwen2",), megatron=mr.ATTENTION + mr.DENSE_MLP),
    # dense and MoE under one record: Qwen3-MoE's rows add the experts (and keep the dense MLP for mlp_only_layers);
    # Qwen3-VL's Megatron checkpoints are this text model with a vision tower, written whole as HF qwen3_vl
    Family("qwen3", ("qwen3", "qwen3_moe"), megatron=mr.ATTENTION + mr.QK_NORM + mr.DENSE_MLP + mr.EXPERTS,
           megatron_vision=mr.qwen3_vl_vision(("qwen3_vl",)),
           torchtitan=tr.NORMS + tr.gqa("rename", "rename") + tr.QK_NORM + tr.DENSE_FFN + tr.ROUTED_EXPERTS + (
               Row("moe.expert_bias_E", "skip", reason="Qwen3-MoE routes by scores alone: torchtitan's "
                                                          "load-balancing bias has no HF equivalent"),),
           torchtitan_marks=("attention.k_norm.weight",)),
    Family("qwen2_moe", ("qwen2_moe",),  # dense rows for mlp_only_layers
           megatron=mr.ATTENTION + mr.DENSE_MLP + mr.EXPERTS + mr.SHARED_EXPERT),
    Family("mixtral", ("mixtral",), megatron=mr.ATTENTION + mr.MIXTRAL_EXPERTS),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"),
           megatron=mr.MLA + mr.DENSE_MLP + mr.DEEPSEEK_MOE,  # dense rows for the first_k_dense_replace layers
           torchtitan=tr.NORMS + tr.MLA + tr.DENSE_FFN + tr.ROUTED_EXPERTS + tr.SHARED_EXPERTS + (
               Row("moe.expert_bias_E", "rename", ("mlp.gate.e_score_correction_bias",)),),
           torchtitan_marks=("attention.wkv_a.weight",),
           # torchtitan's kimi_k2_7 (Kimi-K2.5 / K2.7) is this model with a vision tower: written whole where
           # config.json is transformers' kimi_k25 (the VLM), as its text model (deepseek_v3) with the tower left
           # out where it is the text_config; Megatron's is the text model only
           torchtitan_left_out=tr.VISION_TOWER, text_model_of=("kimi_k25",), torchtitan_vision=tr.KIMI_K25_VISION,
           mtp=NEXTN, config_rows=MLA_CONFIG_ROWS),
    # DeepSeek-V3.2 and GLM-5: DeepSeek-V3 with DeepSeek Sparse Attention's indexer in each attention layer (GLM-5's
    # "shared" layers reuse an earlier layer's choice and hold none)
    Family("deepseek_v32", ("deepseek_v32", "glm_moe_dsa"),
           megatron=mr.MLA + mr.DSA_INDEXER + mr.DENSE_MLP + mr.DEEPSEEK_MOE,
           mtp=NEXTN, config_rows=MLA_CONFIG_ROWS),
    # GLM-4.5 / 4.6: GQA attention (qkv bias, q/k norms when use_qk_norm) before DeepSeek-V3's MoE; its MTP
    # layers are HF's model.layers.{L+k}, as DeepSeek-V3's are. GLM-4.5V's Megatron checkpoints are this text model
    # (glm4v_moe_text) with a vision tower, written whole as HF glm4v_moe
    Family("glm4_moe", ("glm4_moe",), megatron=mr.ATTENTION + mr.QK_NORM + mr.DENSE_MLP + mr.DEEPSEEK_MOE,
           megatron_vision=mr.GLM4V_VISION, mtp=NEXTN),
    # Qwen3.5 / 3.6 dense and MoE (a Gated DeltaNet and gated full attention hybrid, layer_types in config.json):
    # the VLM with its vision tower (qwen3_5, qwen3_5_moe), or the text model alone, the tower left out; Megatron's
    # VLM (Megatron-Bridge's Qwen3VLModel) holds Qwen3-VL's tower without deepstack mergers
    Family("qwen3_5", ("qwen3_5_text", "qwen3_5_moe_text"),
           megatron=mr.GATED_ATTENTION + mr.gated_deltanet("deltanet_in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                                  "in_proj_a"))
           + mr.DENSE_MLP + mr.EXPERTS + mr.SHARED_EXPERT, layer_types=mr.DELTANET_LAYER_TYPES,
           megatron_vision=mr.qwen3_vl_vision(("qwen3_5", "qwen3_5_moe"), deepstack=False),
           mtp=qwen_mtp("mtp_num_hidden_layers"),
           torchtitan=tr.NORMS + tr.QWEN3_5_ATTENTION + tr.GATED_DELTANET + tr.DENSE_FFN + tr.QWEN3_5_MOE,
           torchtitan_marks=("attn.wq.weight", "attn.in_proj_q.weight"), torchtitan_left_out=tr.VISION_TOWER,
           torchtitan_vision=tr.QWEN3_5_VISION),
    # Qwen3-Next: the same hybrid, its Gated DeltaNet's input projection grouped per key head; MoE with a shared
    # expert (dense rows for mlp_only_layers)
    Family("qwen3_next", ("qwen3_next",),
           megatron=mr.GATED_ATTENTION + mr.gated_deltanet("deltanet_in_proj_grouped", ("in_proj_qkvz", "in_proj_ba"))
           + mr.DENSE_MLP + mr.EXPERTS + mr.SHARED_EXPERT, layer_types=mr.DELTANET_LAYER_TYPES,
           mtp=qwen_mtp("num_nextn_predict_layers")),
    # Nemotron-H: Mamba2, attention and MLP layers by the hybrid pattern (layers_block_type in config.json), which
    # transformers saves under `backbone.` (its module names are `model.`)
    Family("nemotron_h", ("nemotron_h",), megatron=mr.NEMOTRON_H,
           hf_prefixes=(("model.embed_tokens.", "backbone.embeddings."), ("model.norm.", "backbone.norm_f."),
                        ("model.layers.", "backbone.layers."))),
    Family("gpt_oss", ("gpt_oss",), megatron=mr.ATTENTION + mr.GPT_OSS, torchtitan=tr.NORMS + tr.GPT_OSS,
           torchtitan_marks=("moe.routed_experts.inner_experts.mlp1_weight_EGD",)),
    # MiniMax-M2: q/k norms across all heads (heads x head_dim, split over TP with the heads: sources/megatron_tp.py)
    Family("minimax_m2", ("minimax_m2",), megatron=mr.ATTENTION + mr.QK_NORM + mr.MINIMAX_M2_MOE,
           config_rows=FULL_WIDTH_QK_NORMS),
    # ERNIE-4.5-MoE: interleaved RoPE (Megatron's rotary_interleaved, so q/k are HF's as they are), dense first
    # layers (moe_layer_start_index) then a softmax router, routed and shared experts
    Family("ernie4_5_moe", ("ernie4_5_moe",), megatron=mr.ATTENTION + mr.DENSE_MLP + mr.ERNIE_MOE),
    # OLMoE: MiniMax-M2's full-width q/k norms, a softmax router and routed experts in every layer
    Family("olmoe", ("olmoe",), megatron=mr.ATTENTION + mr.QK_NORM + mr.EXPERTS, config_rows=FULL_WIDTH_QK_NORMS),
    # Hunyuan v3: per-head q/k norms, dense first layers (mlp_layer_types) then DeepSeek-V3's MoE, renamed
    Family("hy_v3", ("hy_v3",), megatron=mr.ATTENTION + mr.QK_NORM + mr.DENSE_MLP + mr.HY_V3_MOE),
    # Qwen3-VL-MoE's text model: Qwen3-MoE's, its experts stacked as transformers saves them (dense rows for
    # mlp_only_layers); written only with its vision tower, as HF qwen3_vl_moe
    Family("qwen3_vl_moe", ("qwen3_vl_moe_text",),
           megatron=mr.ATTENTION + mr.QK_NORM + mr.DENSE_MLP + mr.QWEN3_VL_MOE_EXPERTS,
           megatron_vision=mr.qwen3_vl_vision(("qwen3_vl_moe",)), vlm_only=True),
    # MiMo-V2-Flash: full and sliding-window layers (layer_types) with their own key-value heads, sinks on the
    # sliding ones, values narrower than q/k (v_head_dim); a dense first layer, then a sigmoid-routed MoE
    Family("mimo_v2_flash", ("mimo_v2_flash",), megatron=mr.MIMO_V2_FLASH),
)
MEGATRON_FAMILIES = tuple(f for f in FAMILIES if f.megatron)
TORCHTITAN_FAMILIES = tuple(f for f in FAMILIES if f.torchtitan)


def _one_family_per_model_type(families: tuple[Family, ...]) -> None:
    owner: dict[str, str] = {}
    for family in families:
        for model_type in family.model_types + family.vlm_types():
            if owner.setdefault(model_type, family.name) != family.name:
                raise ValueError(f"model type {model_type!r} belongs to families {owner[model_type]} and {family.name}")


def tp_split_known(families: tuple[Family, ...]) -> None:
    """Every Megatron row names a tensor whose TP split is known (family_file.py checks a user's rows too). A vision
    tower's rows are checked by their full names: one kept as HF's own module is told by its prefix."""
    tables = [(f"the {f.name} family", "", f.megatron) for f in families] + [
        (f"the {f.name} family's vision tower", prefix, rows)
        for f in families if (tower := f.megatron_vision)
        for prefix, rows in (("", tower.globals), (tower.blocks, tower.rows),
                             *((start, rows) for start, _, rows in tower.lists))] + [
        ("Megatron's global rows", "", mr.MEGATRON.globals), ("Megatron's MTP rows", "", mr.MEGATRON.mtp.rows)]
    for where, prefix, rows in tables:
        for row in rows:
            if not split_known(prefix + row.source):
                raise ValueError(f"row {row.source!r} of {where}: sources/megatron_tp.py does not say how TP splits it")


def _mtp_own_names_known(families: tuple[Family, ...]) -> None:
    """A layout that names an MTP layer's own tensors names every one each naming gives (none is left to fall under
    the layer) and no other."""
    for family in families:
        if family.mtp and family.mtp.own:
            for naming in (mr.MEGATRON, tr.TORCHTITAN):
                given = {t for row in naming.mtp.rows for t in row.targets}
                if given != set(family.mtp.own):
                    raise ValueError(f"family {family.name}: its MTP layout names {sorted(family.mtp.own)}, "
                                     f"{naming.name}'s MTP rows give {sorted(given)}")


def _unmarked_torchtitan_family(families: tuple[Family, ...]) -> Family:
    torchtitan = [f for f in families if f.torchtitan]
    for family in torchtitan:
        for mark in family.torchtitan_marks:
            others = [f.name for f in torchtitan if f is not family and any(r.source == mark for r in f.torchtitan)]
            if others:
                raise ValueError(f"family {family.name}: mark {mark!r} is also a row of {', '.join(others)}")
    unmarked = [f for f in torchtitan if not f.torchtitan_marks]
    if len(unmarked) != 1:
        raise ValueError(f"torchtitan families without marks: {[f.name for f in unmarked]}; exactly one is needed")
    return unmarked[0]


def checked_together(families: tuple[Family, ...]) -> Family:
    """Raises where the records disagree with one another; returns the torchtitan family without marks."""
    _one_family_per_model_type(families)
    tp_split_known(families)
    _mtp_own_names_known(families)
    return _unmarked_torchtitan_family(families)


TORCHTITAN_UNMARKED = checked_together(FAMILIES)


def megatron_family(model_type: str) -> Family | None:
    return next((f for f in MEGATRON_FAMILIES if model_type in f.model_types), None)
