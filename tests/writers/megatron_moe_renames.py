"""Write ERNIE-4.5-MoE, OLMoE and Hunyuan v3 Megatron checkpoints with megatron-core, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_moe_renames --out ROOT --case ernie:arch=ernie4_5_moe

Tiny models as the three are built (local spec, GQA attention without biases, 4 experts, TP 2 and EP 2 with expert
TP 1 on 2 ranks by default), each as megatron-core expresses that family:
- `arch=ernie4_5_moe`: interleaved RoPE (`rotary_interleaved`, ERNIE pairs adjacent channels), a dense first layer
  then MoE layers, a softmax router choosing the top k by logit, its weights the softmax over the chosen
  (transformers' ERNIE: the top k of the softmax plus its `moe_statics` bias, renormalised; megatron-core refuses an
  expert bias with a softmax router, so the bias is 0), one shared expert;
- `arch=olmoe`: q/k RMSNorms across all heads (megatron_gpt_oss_minimax.FullWidthRMSNorm: megatron-core's own
  are per head), every layer MoE, the softmax over all experts then the top k, not renormalised
  (`moe_router_pre_softmax`, OLMoE's norm_topk_prob false), no shared expert;
- `arch=hy_v3`: per-head q/k norms, a dense first layer then MoE layers, a sigmoid router whose expert bias steers
  the choice, its top-k weights renormalised and scaled, one shared expert.
Vectors and experts are drawn from their global names (megatron_gpt_oss_minimax.distinct_values), so TP halves of
the full-width norms and EP ranks' experts differ. Saved by megatron_checkpoint.py's write_model (legacy/, dist/,
hf/, logits.pt with Megatron's own forward logits: megatron_deepseek.py's oracle).
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import cpu_patches, parse, write_cases, write_model
from tests.writers.megatron_deepseek import oracle
from tests.writers import megatron_gpt_oss_minimax as oss_minimax
from tests.writers.megatron_gpt_oss_minimax import EXPERTS, SPLIT_UNFLAGGED, FullWidthRMSNorm

DEFAULTS = dict(arch="ernie4_5_moe", tp=2, ep=2, layers=2, dense=1, heads=4, groups=2, vocab=101, mtp=0)
HIDDEN, HEAD_DIM, FFN, MOE_FFN, TOPK, SCALE = 64, 16, 40, 24, 2, 2.5
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def dense_layers(a: Namespace) -> int:
    return 0 if a.arch == "olmoe" else a.dense


def moe_config(a: Namespace, moe_layer_freq: list[int]) -> dict:
    """The TransformerConfig keywords this writer's models share with megatron_mimo_v2_flash.py's: RMSNorm, SiLU
    GLU, no linear biases, TP a.tp and EP a.ep with expert TP 1, a MoE layer where `moe_layer_freq` says 1."""
    return dict(
        num_layers=a.layers, hidden_size=HIDDEN, num_attention_heads=a.heads, num_query_groups=a.groups,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, tensor_model_parallel_size=a.tp,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, init_method_std=0.05, num_moe_experts=EXPERTS,
        moe_layer_freq=moe_layer_freq, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=TOPK,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False)


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    kw = moe_config(a, [0] * dense_layers(a) + [1] * (a.layers - dense_layers(a)))
    if a.arch == "ernie4_5_moe":
        return TransformerConfig(rotary_interleaved=True, moe_router_score_function="softmax",
                                 moe_shared_expert_intermediate_size=MOE_FFN, **kw)
    if a.arch == "olmoe":
        return TransformerConfig(qk_layernorm=True, moe_router_score_function="softmax", moe_router_pre_softmax=True,
                                 **kw)
    return TransformerConfig(qk_layernorm=True, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=SCALE,
                             moe_shared_expert_intermediate_size=MOE_FFN, **kw)


def hf_config(a: Namespace):
    import transformers

    common = dict(vocab_size=a.vocab, hidden_size=HIDDEN, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.groups, rms_norm_eps=1e-5, max_position_embeddings=64,
                  tie_word_embeddings=False, rope_parameters=ROPE)
    if a.arch == "ernie4_5_moe":  # its head dim is hidden / heads (HEAD_DIM here)
        return transformers.Ernie4_5_MoeConfig(
            intermediate_size=FFN, moe_intermediate_size=MOE_FFN, moe_k=TOPK, moe_num_experts=EXPERTS,
            moe_num_shared_experts=1, moe_layer_start_index=a.dense, moe_layer_interval=1, **common)
    if a.arch == "olmoe":  # its q/k norms are hidden wide: hidden / heads is HEAD_DIM here too
        return transformers.OlmoeConfig(intermediate_size=MOE_FFN, num_experts=EXPERTS, num_experts_per_tok=TOPK,
                                        norm_topk_prob=False, pad_token_id=None, eos_token_id=None, **common)
    return transformers.HYV3Config(
        head_dim=HEAD_DIM, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, num_experts=EXPERTS,
        num_experts_per_tok=TOPK, num_shared_experts=1, router_scaling_factor=SCALE,
        mlp_layer_types=["dense"] * a.dense + ["sparse"] * (a.layers - a.dense), **common)


def block_spec(a: Namespace, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if a.arch == "olmoe":
        for layer in block.layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": a.heads})
            attention.k_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": a.groups})
    return block


def build_model(a: Namespace, config):
    # per-head q/k norms (hy_v3's) are whole on every TP rank; OLMoE's full-width ones are split with the heads
    return oss_minimax.build_model(a, config, block_spec(a, config), SPLIT_UNFLAGGED if a.arch == "olmoe" else ())


def write_expert_parallel(a: Namespace, out: Path, build, config, hf) -> None:
    """The model `build(a, config(a))` at TP a.tp and EP a.ep with expert TP 1, saved by write_model with Megatron's
    logits and the HF config `hf(a)` (this writer's and megatron_mimo_v2_flash.py's cases)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1)
    model = build(a, config(a))
    write_model(a, model, out, lambda: oracle(a, model), lambda: hf(a))
    ps.destroy_model_parallel()


def write_case(a: Namespace, out: Path) -> None:
    write_expert_parallel(a, out, build_model, transformer_config, hf_config)


def main() -> None:
    out, cases = parse(DEFAULTS, "arch: ernie4_5_moe, olmoe or hy_v3; ep: expert-parallel size (expert TP is 1); "
                       "dense: how many first layers have a dense MLP (none for olmoe)",
                       fixed=dict(pp=1, vpp=None, tied=False, etp=1))
    cpu_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
