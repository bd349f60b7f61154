"""Write Gated DeltaNet hybrid Megatron checkpoints (Qwen3-Next, Qwen3.5) with megatron-core, on CPU under gloo.

    torchrun --nproc_per_node 2 -m tests.writers.megatron_gdn --out ROOT --case next:arch=qwen3_next,tp=2

A tiny model as Qwen3-Next and Qwen3.5 are built: Gated DeltaNet layers (megatron-core's GatedDeltaNet with its
torch paths, see shared/FORMATS.md) and gated full attention (`attention_output_gate`, q/k norms, partial
rotary) in the order `pattern` gives (l: linear, f: full), zero-centred RMSNorms everywhere, then a dense MLP or
(`moe=1`) routed experts with a shared expert behind its sigmoid gate, and `mtp` multi-token-prediction layers,
each a full-attention layer, as Qwen3-Next's and Qwen3.5's is (on the last pipeline stage, where megatron-core
places them, beside its own copy of the embedding). megatron-core's experimental block spec
needs Transformer Engine, so the layers are built by hand from the local spec; the GDN layer's input norm is
saved under TE's name (`self_attention.in_proj.layer_norm_weight`) as the TE spec fuses it. Every rank builds
its slice from one seed and saves it as megatron_checkpoint.py does, into ROOT/NAME/: legacy/ and dist/, hf/
(the transformers config and a tokenizer) and logits.pt ("tokens", "logits": Megatron's own forward logits,
sliced to the HF vocab size; with MTP also "mtp_logits" and "mtp_params" as tests/writers/megatron_deepseek.py
saves them).
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.writers import megatron_deepseek
from tests.writers.megatron_checkpoint import (cpu_patches, forward_logits, padded_vocab, parse, randomise_vectors,
                                               write_cases, write_model)

DEFAULTS = dict(arch="qwen3_5_text", tp=1, pp=1, ep=1, moe=0, pattern="lfl", mtp=0, vocab=101)
HIDDEN, HEADS, GROUPS, HEAD_DIM, ROTARY, FFN = 64, 4, 2, 16, 0.25, 48
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, CONV = 2, 4, 8, 8, 4
EXPERTS, TOPK, MOE_FFN, SHARED_FFN = 4, 2, 24, 32


def gdn_patches() -> None:
    """GatedDeltaNet without fla: its torch l2norm (fla's, as HF's torch fallback computes it); the torch conv1d and
    chunked delta rule come with deterministic_mode. megatron-core 0.16 keeps them in the module gated_delta_net,
    0.19 in that package's common module (megatron_qwen3_5_vl.py writes with 0.19)."""
    try:
        from megatron.core.ssm.gated_delta_net import common as gated_delta_net
    except ImportError:
        from megatron.core.ssm import gated_delta_net

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = lambda x: x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class ZeroCentredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by 1 + weight (Megatron's layernorm_zero_centered_gamma, which the local spec's torch norm
    refuses), as TE's RMSNorm computes it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1 + self.weight.float())).type_as(x)


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=len(a.pattern), hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        attention_output_gate=True, qk_layernorm=True, linear_conv_kernel_dim=CONV, linear_key_head_dim=KEY_DIM,
        linear_value_head_dim=VALUE_DIM, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        # the pattern as Megatron-LM gives it (1: a Gated DeltaNet): torch_dist then keys each layer by number
        linear_attention_freq=[int(c == "l") for c in a.pattern],
        deterministic_mode=True, tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=getattr(a, "etp", None),  # None: as TP
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, init_method_std=0.05, mtp_num_layers=a.mtp or None)
    if a.moe:  # softmax over all experts, the top k renormalised (norm_topk_prob)
        kw.update(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                  moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_permute_fusion=False, moe_aux_loss_coeff=0.0)
    return TransformerConfig(**kw)


def layer_spec(a: Namespace, letter: str):
    """A Gated DeltaNet (l) or full-attention (f) layer from the local spec with zero-centred norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if a.moe else None, qk_layernorm=True,
                                    normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCentredRMSNorm
    if letter == "l":
        sub.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=ZeroCentredRMSNorm, out_proj=RowParallelLinear))
        sub.sharded_state_dict_keys_map = dict(sub.sharded_state_dict_keys_map,
                                               **{"input_layernorm.": "self_attention.in_proj.layer_norm_"})
    else:
        sub.self_attention.submodules.q_layernorm = ZeroCentredRMSNorm
        sub.self_attention.submodules.k_layernorm = ZeroCentredRMSNorm
    return spec


def block_spec(a: Namespace, config):
    """One layer spec per letter of the pattern this pipeline stage builds."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first = get_transformer_layer_offset(config)
    layers = [layer_spec(a, letter) for letter in a.pattern[first:first + get_num_layers_to_build(config)]]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCentredRMSNorm)


def mtp_block_spec(a: Namespace, config):
    """The MTP layers (None without, and on the pipeline stages before the last): megatron-core's MTP spec around a
    full-attention layer, its enorm, hnorm and final norm zero-centred as every norm of these models is."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    class ZeroCentredNorms(LocalSpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return ZeroCentredRMSNorm

    # without a custom pipeline layout megatron-core puts the MTP layers on the last stage (mtp_on_this_rank, whose
    # arguments 0.16 and 0.19 name differently)
    if not a.mtp or not ps.is_pipeline_last_stage():
        return None
    return get_gpt_mtp_block_spec_for_backend(config, layer_spec(a, "f"), ZeroCentredNorms())


def hf_config(a: Namespace):
    import transformers

    kw = dict(vocab_size=a.vocab, hidden_size=HIDDEN, num_hidden_layers=len(a.pattern), num_attention_heads=HEADS,
              num_key_value_heads=GROUPS, head_dim=HEAD_DIM, intermediate_size=FFN, rms_norm_eps=1e-6,
              max_position_embeddings=64, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY},
              linear_conv_kernel_dim=CONV, linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
              linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
              layer_types=["linear_attention" if c == "l" else "full_attention" for c in a.pattern])
    moe = dict(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=MOE_FFN,
               shared_expert_intermediate_size=SHARED_FFN)
    if a.arch == "qwen3_next":
        return transformers.Qwen3NextConfig(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **moe,
                                            **kw)
    if a.arch == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig(**moe, **kw)
    return transformers.Qwen3_5TextConfig(**kw)


def forward(a: Namespace, model) -> dict | None:
    """Megatron's logits over the whole pipeline (on its last stage; None elsewhere); with MTP its MTP layers'
    logits and own tensors too."""
    if a.mtp:
        return megatron_deepseek.oracle(a, model)
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64, 8]])
    logits = forward_logits(a, [model], tokens)
    return None if logits is None else {"tokens": tokens, "logits": logits}


def build(a: Namespace, config):
    """This rank's slice of the model (parallel state initialised), its norms randomised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
    model = GPTModel(config=config, transformer_layer_spec=block_spec(a, config),
                     vocab_size=padded_vocab(a.vocab, a.tp), max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000,
                     rotary_percent=ROTARY, parallel_output=False, mtp_block_spec=mtp_block_spec(a, config)).eval()
    randomise_vectors([model])
    return model


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, a.pp, expert_model_parallel_size=a.ep)
    model = build(a, transformer_config(a))
    write_model(a, model, out, lambda: forward(a, model), lambda: hf_config(a))
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = parse(DEFAULTS, "arch: qwen3_5_text, qwen3_5_moe_text or qwen3_next; pattern: the layers, l a Gated "
                       "DeltaNet, f full attention; moe: routed experts and a shared expert; pp, ep: pipeline and "
                       "expert-parallel sizes; mtp: multi-token-prediction layers",
                       fixed=dict(vpp=None, tied=False))
    cpu_patches()
    gdn_patches()
    for _, a in cases:
        a.layers = len(a.pattern)  # what save_legacy records in the args
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
