"""Write DeepSeek-V3-style Megatron checkpoints with megatron-core, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_deepseek --out ROOT --case dsv3:tp=2,mtp=1

A tiny model as DeepSeek-V3 is built: multi-latent attention (with q-LoRA, or `q_lora=0` without), dense first
layers then MoE layers (`moe_layer_freq` as a list), a sigmoid router with expert bias and group-limited
routing, shared experts, and `mtp` multi-token-prediction layers. `arch=glm4_moe` builds GLM-4.5's variant of
that model: GQA attention with qkv bias, partial rotary, a head dim other than hidden / heads, q/k norms with
`qk_norm=1`, and the same MoE without routing groups. `arch=llama` builds a plain GQA model with MTP layers
instead (a checkpoint whose HF family has no MTP). Every rank builds its slice from one seed
(local spec, `use_cpu_initialization`) and saves it as megatron_checkpoint.py does, into ROOT/NAME/:
legacy/ and dist/ (Megatron-LM save dirs), hf/ (the transformers config and a tokenizer) and logits.pt:
- "tokens", "logits": Megatron's own forward logits, sliced to the HF vocab size;
- with MTP, "mtp_logits": the logits Megatron's MTP layers give (the shared output layer on each MTP layer's
  output; position i predicts token i + 2, the last position sees a rolled-in pad), and "mtp_params":
  each MTP layer's own tensors (enorm, hnorm, eh_proj gathered over TP, final_layernorm) by Megatron name.
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import (cpu_patches, padded_vocab, parse, randomise_vectors, write_cases,
                                               write_model)

DEFAULTS = dict(arch="deepseek_v3", tp=1, ep=1, layers=2, dense=1, q_lora=1, qk_norm=0, mtp=1, vocab=101)
HIDDEN, HEADS, FFN, MOE_FFN, EXPERTS = 32, 4, 40, 24, 4
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 24, 16, 8, 8, 8
GLM_HEAD_DIM, GLM_ROTARY = 16, 0.5  # GLM-4.5's heads are wider than hidden / heads; rotary on half of each head


def moe_config(a: Namespace) -> dict:
    """The MoE both families share: sigmoid scores whose expert bias steers the choice (not the weights), top-k
    weights normalised then scaled, one shared expert, the first `dense` layers dense."""
    return dict(
        num_moe_experts=EXPERTS, moe_layer_freq=[0] * a.dense + [1] * (a.layers - a.dense),
        moe_ffn_hidden_size=MOE_FFN, moe_shared_expert_intermediate_size=MOE_FFN, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_permute_fusion=False)


def mla_patches() -> None:
    """MLA with the local spec on CPU (see shared/FORMATS.md): core attention that takes k/v channels, no TE."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *a, k_channels=None, v_channels=None, **kw):
            super().__init__(*a, **kw)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    LocalSpecProvider.core_attention = lambda self: MLADotProductAttention
    mla.HAVE_TE = False


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = dict(
        num_layers=a.layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, tensor_model_parallel_size=a.tp, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, init_method_std=0.05, mtp_num_layers=a.mtp or None,
        expert_model_parallel_size=a.ep,
    )
    if a.arch == "llama":
        return TransformerConfig(num_query_groups=2, kv_channels=HIDDEN // HEADS, **kw)
    if a.arch == "glm4_moe":  # its partial rotary is GPTModel's rotary_percent (build_model)
        return TransformerConfig(num_query_groups=2, kv_channels=GLM_HEAD_DIM, add_qkv_bias=True,
                                 qk_layernorm=bool(a.qk_norm), **moe_config(a), **kw)
    # MLA: the q/kv LoRA norms are Megatron's q/kv layernorms (qk_layernorm). The softmax scale includes YaRN's
    # mscale even with plain rope, so the scaling factor stays 1 to match HF's rope_type "default".
    return MLATransformerConfig(
        multi_latent_attention=True, q_lora_rank=Q_LORA if a.q_lora else None, kv_lora_rank=KV_LORA,
        qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, qk_layernorm=True, rope_type="rope",
        rotary_base=10000, rotary_scaling_factor=1.0, moe_router_num_groups=2, moe_router_group_topk=1,
        **moe_config(a), **kw)


def hf_config(a: Namespace):
    import transformers

    common = dict(vocab_size=a.vocab, hidden_size=HIDDEN, num_hidden_layers=a.layers, num_attention_heads=HEADS,
                  rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0)
    if a.arch == "llama":
        return transformers.LlamaConfig(intermediate_size=FFN, num_key_value_heads=2, **common)
    moe = dict(intermediate_size=FFN, moe_intermediate_size=MOE_FFN, n_shared_experts=1, n_routed_experts=EXPERTS,
               num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=a.dense)
    if a.arch == "glm4_moe":  # num_nextn_predict_layers left at its default, as for DeepSeek-V3 below
        return transformers.Glm4MoeConfig(
            num_key_value_heads=2, head_dim=GLM_HEAD_DIM, attention_bias=True, use_qk_norm=bool(a.qk_norm),
            partial_rotary_factor=GLM_ROTARY, n_group=1, topk_group=1, **moe, **common)
    # Megatron scores a routing group by its top topk/group_topk experts, HF by its top 2: equal here (2/1).
    # SDPA needs num_key_value_heads == num_attention_heads. num_nextn_predict_layers is left at its default:
    # the merge sets it to the MTP layers the checkpoint holds.
    return transformers.DeepseekV3Config(
        num_key_value_heads=HEADS, n_group=2, topk_group=1, q_lora_rank=Q_LORA if a.q_lora else None,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, rope_interleave=True,
        **moe, **common)


def build_model(a: Namespace, config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False) if a.mtp else None
    torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=padded_vocab(a.vocab, a.tp),
                     max_sequence_length=64, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=10000, rotary_percent=GLM_ROTARY if a.arch == "glm4_moe" else 1.0,
                     parallel_output=False, mtp_block_spec=mtp).eval()
    randomise(model)
    return model


def randomise(model) -> None:
    """Norms and biases randomised (megatron_checkpoint.randomise_vectors), and the routers' expert bias, which
    starts at 0 and is a buffer: the same on every rank."""
    randomise_vectors([model])
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)


def forward(a: Namespace, model, tokens: tuple[int, ...] = (3, 17, 42, 5, 99, 64, 8)) -> dict | None:
    """Megatron's logits for `tokens`, read off the output layer: with MTP the forward needs labels and returns the
    loss, calling the shared output layer on each MTP layer's output first and on the main output last. Over
    pipeline stages each stage runs on the hidden states the one before sends it, and the last one (which holds the
    output layer and the MTP layers) gives the logits; None on the others."""
    from megatron.core import parallel_state as ps

    tokens = torch.tensor([tokens])
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq)[None]
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(seq, 1, model.config.hidden_size)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    if not ps.is_pipeline_last_stage():
        with torch.no_grad():
            dist.send(model(tokens, positions, mask).contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    calls = []  # copies: the loss then works on the logits in place
    hook = model.output_layer.register_forward_hook(lambda m, i, out: calls.append(out[0].transpose(0, 1).clone()))
    with torch.no_grad():
        model(tokens, positions, mask, labels=tokens if a.mtp else None)
    hook.remove()
    out = {"tokens": tokens, "logits": calls[-1][..., :a.vocab]}
    if a.mtp:
        out["mtp_logits"] = [c[..., :a.vocab] for c in calls[:-1]]
    return out


def mtp_params(model) -> dict[str, torch.Tensor]:
    """Each MTP layer's own tensors, whole: eh_proj is column-parallel (rows split over TP)."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, param in model.mtp.named_parameters():
        if ".transformer_layer." in name or ".mtp_model_layer." in name:  # megatron-core 0.16 / 0.19's name
            continue
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(param) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, param.contiguous(), group=ps.get_tensor_model_parallel_group())
            param = torch.cat(parts, dim=param.partition_dim)
        out[f"mtp.{name}"] = param.detach().clone()
    return out


def oracle(a: Namespace, model) -> dict | None:
    """What logits.pt holds: Megatron's logits and, with MTP, its layers' logits and own tensors (on the last
    pipeline stage; None on the others)."""
    out = forward(a, model)
    if out is not None and a.mtp:
        out["mtp_params"] = mtp_params(model)
    return out


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep)
    config = transformer_config(a)
    model = build_model(a, config)
    write_model(a, model, out, lambda: oracle(a, model), lambda: hf_config(a))
    ps.destroy_model_parallel()


def main() -> None:
    # What megatron_checkpoint.save_legacy records in the args: one pipeline stage, untied.
    out, cases = parse(DEFAULTS, "arch: deepseek_v3, glm4_moe or llama; ep: expert-parallel size; "
                       "dense: how many first layers have a dense MLP; "
                       "qk_norm: glm4_moe's q/k norms",
                       fixed=dict(pp=1, vpp=None, tied=False))
    cpu_patches()
    mla_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
