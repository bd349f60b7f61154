"""Write MiMo-V2-Flash Megatron checkpoints with megatron-core 0.19.2, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_mimo_v2_flash --out ROOT --case mimo:tp=2

megatron-core has no MiMo-V2-Flash attention of its own: Megatron-Bridge trains it with its MiMoV2FlashSelfAttention
(a megatron-core SelfAttention subclass) and a Transformer Engine core attention (shared/FORMATS.md). This writer
builds the same modules on the local spec, as the bridge's models/mimo_v2_flash/modeling_mimo_v2_flash.py does:
- MiMoSelfAttention: the layer's own query groups (a sliding-window layer twice the full layers', as transformers'
  MiMoV2FlashAttention has them), a fused linear_qkv of per group [q heads; k; v] with values V_HEAD_DIM wide
  (narrower than the q/k head dim), linear_proj from heads x V_HEAD_DIM, and the layer type's rotary embedding out
  of the [local, global] pair DualRotary gives;
- MiMoCoreAttention: megatron-core's DotProductAttention with learnable sinks (`softmax_offset`, split over TP
  with the heads) and the window on sliding-window layers only, values scaled by VALUE_SCALE, its context
  heads x V_HEAD_DIM wide.
Tiny model: a full-attention dense first layer, then a sliding-window and a full-attention MoE layer (4 experts,
a sigmoid router whose expert bias steers the choice, top-k weights renormalised and scaled, no shared expert),
partial rotary with a RoPE base per layer type; TP 2 and EP 2 with expert TP 1 by default. Values drawn apart per
global name (megatron_gpt_oss_minimax.distinct_values); saved by megatron_checkpoint.py's write_model (legacy/,
dist/ with hetereogenous_dist_checkpoint as the bridge saves it, hf/, logits.pt with Megatron's own logits), as
megatron_moe_renames.py's cases are.
"""
from __future__ import annotations

import copy
from argparse import Namespace
from pathlib import Path

import torch

from tests.writers import megatron_gpt_oss_minimax as oss_minimax
from tests.writers.megatron_checkpoint import cpu_patches, parse, write_cases
from tests.writers.megatron_gpt_oss_minimax import EXPERTS, SPLIT_UNFLAGGED, sliding_window_on_cpu
from tests.writers.megatron_moe_renames import (FFN, HEAD_DIM, HIDDEN, MOE_FFN, SCALE, TOPK, moe_config,
                                                write_expert_parallel)

DEFAULTS = dict(arch="mimo_v2_flash", tp=2, ep=2, heads=8, groups=2, vocab=101, mtp=0)  # groups: a full layer's
V_HEAD_DIM = 8  # narrower than megatron_moe_renames.HEAD_DIM, the q/k heads'
LAYER_TYPES = ("full_attention", "sliding_attention", "full_attention")
MLP_TYPES = ("dense", "sparse", "sparse")
WINDOW, VALUE_SCALE, ROTARY = 3, 0.6, 0.5  # HF's sliding_window (tokens seen, itself included)
ROPE_BASE = {"full_attention": 10000, "sliding_attention": 500}  # apart, so a layer given the other's fails


def _sliding(layer_number: int) -> bool:
    return LAYER_TYPES[layer_number - 1] == "sliding_attention"


def _dual_rotary_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class DualRotary(RotaryEmbedding):
        """The bridge's MiMoV2FlashRotaryEmbedding: both layer types' embeddings, stacked [local, global]."""

        def __init__(self, **kw):
            super().__init__(rotary_base=ROPE_BASE["full_attention"], **kw)
            self.rope_local = RotaryEmbedding(rotary_base=ROPE_BASE["sliding_attention"], **kw)

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            return torch.stack([self.rope_local(max_seq_len, offset, packed_seq, cp_group),
                                super().forward(max_seq_len, offset, packed_seq, cp_group)])

    return DualRotary


def _attention_classes():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MiMoSelfAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number, *args, **kwargs):
            config = copy.deepcopy(config)
            sliding = _sliding(layer_number)
            if sliding:
                config.num_query_groups *= 2
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.sliding = sliding
            groups, heads = config.num_query_groups, config.num_attention_heads
            self.linear_qkv = submodules.linear_qkv(
                config.hidden_size, HEAD_DIM * heads + (HEAD_DIM + V_HEAD_DIM) * groups, config=config,
                init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
            self.linear_proj = submodules.linear_proj(
                V_HEAD_DIM * heads, config.hidden_size, config=config, init_method=config.output_layer_init_method,
                bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
                tp_group=self.pg_collection.tp)

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                        split_qkv=True):
            mixed, _ = self.linear_qkv(hidden_states)
            groups = self.num_query_groups_per_partition
            per = self.num_attention_heads_per_partition // groups
            mixed = mixed.view(*mixed.shape[:-1], groups, per * HEAD_DIM + HEAD_DIM + V_HEAD_DIM)
            query, key, value = torch.split(mixed, [per * HEAD_DIM, HEAD_DIM, V_HEAD_DIM], dim=3)
            return query.reshape(*query.shape[:2], -1, HEAD_DIM), key, value

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            return super().forward(hidden_states, attention_mask, *args,
                                   rotary_pos_emb=rotary_pos_emb[0 if self.sliding else 1], **kwargs)

    class MiMoCoreAttention(DotProductAttention):
        def __init__(self, config, layer_number, *args, **kwargs):
            config = copy.deepcopy(config)
            sliding = _sliding(layer_number)
            config.window_size = (WINDOW - 1, 0) if sliding else None
            config.softmax_type = "learnable" if sliding else "vanilla"
            super().__init__(config, layer_number, *args, **kwargs)
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * V_HEAD_DIM

        def forward(self, query, key, value, *args, **kwargs):
            return super().forward(query, key, value * VALUE_SCALE, *args, **kwargs)

    return MiMoSelfAttention, MiMoCoreAttention


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=SCALE,
        hetereogenous_dist_checkpoint=True, **moe_config(a, [int(t == "sparse") for t in MLP_TYPES]))


def hf_config(a: Namespace):
    import transformers

    return transformers.MiMoV2FlashConfig(
        vocab_size=a.vocab, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=a.heads, num_key_value_heads=a.groups,
        head_dim=HEAD_DIM, v_head_dim=V_HEAD_DIM, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
        routed_scaling_factor=SCALE, layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
        sliding_window=WINDOW, attention_value_scale=VALUE_SCALE, rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        rope_parameters={t: {"rope_type": "default", "rope_theta": float(base), "partial_rotary_factor": ROTARY}
                         for t, base in ROPE_BASE.items()})


def block_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    self_attention, core_attention = _attention_classes()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        layer.submodules.self_attention.module = self_attention
        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=core_attention)
    return block


def build_model(a: Namespace, config):
    model = oss_minimax.build_model(a, config, block_spec(config), SPLIT_UNFLAGGED)
    model.rotary_pos_emb = _dual_rotary_class()(kv_channels=HEAD_DIM, rotary_percent=ROTARY,
                                                use_cpu_initialization=True)
    return model


def write_case(a: Namespace, out: Path) -> None:
    write_expert_parallel(a, out, build_model, transformer_config, hf_config)


def main() -> None:
    out, cases = parse(DEFAULTS, "arch: mimo_v2_flash only; ep: expert-parallel size (expert TP is 1); groups: a "
                       "full-attention layer's query groups (a sliding-window layer has twice as many)",
                       fixed=dict(pp=1, vpp=None, tied=False, etp=1, layers=len(LAYER_TYPES)))
    cpu_patches()
    sliding_window_on_cpu()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
