"""Write DeepSeek Sparse Attention Megatron checkpoints (DeepSeek-V3.2, GLM-5) with megatron-core 0.19.2, on CPU
under gloo. megatron-core has DSA from 0.17 on, which needs Python >= 3.12: this writer runs from the writer venv
that `make writers312` builds (.venv-writers312), not from the project's venv.

    .venv-writers312/bin/torchrun --nproc_per_node 2 -m tests.writers.megatron_dsa --out ROOT --case dsv32:tp=2

The model is DeepSeek-V3's (tests/writers/megatron_deepseek.py: MLA with q-LoRA, a dense first layer, then MoE
with a sigmoid router, expert bias and shared experts, `mtp` multi-token-prediction layers) with megatron-core's
DSA attention: AbsorbedMLASelfAttention whose core attention holds the lightning indexer (`linear_wq_b`,
`linear_wk`, `k_norm`, `linear_weights_proj`), which keeps the top `TOPK` keys of each query. `arch=glm_moe_dsa`
is GLM-5's variant: interleaved RoPE in the indexer, one routing group, and with `share=N` the indexer on every
N-th layer only (the others reuse its top-k and hold no indexer). `down=linear` keeps the DSA spec's own q/kv down
projections, whole on every rank (its `linear()`, as TE's spec holds them, a duplicated TELinear) instead of
column-parallel ones. Every rank builds its slice from one seed and saves it as legacy and torch_dist into
ROOT/NAME/legacy/ and dist/ (Megatron-LM save dirs), beside hf/ (the transformers config and a
tokenizer) and logits.pt: "tokens", "logits" (Megatron's own fp32 forward, sliced to the HF vocab size) and, with
MTP, "mtp_logits" (as tests/writers/megatron_deepseek.py records them).

On CPU (see shared/FORMATS.md): no Transformer Engine, so the layer specs are built with the local backend, whose
`linear()` (the indexer's replicated projections, and with `down=linear` the q/kv down projections) is modelopt's
Linear saving under the TP group; by default the q/kv down projections are ColumnParallel as in the local MLA
spec; the Hadamard rotation is off (orthogonal: q.k is the same, and transformers leaves it out for that reason);
TP > 1 runs DSA with sequence parallelism, so the sequence is a multiple of TP.
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import (cpu_patches, padded_vocab, parse, save_dist, save_legacy, write_cases,
                                               write_save_dirs)
from tests.writers.megatron_deepseek import EXPERTS, MOE_FFN, forward, moe_config, mtp_params, randomise

DEFAULTS = dict(arch="deepseek_v32", tp=1, ep=1, layers=2, dense=1, mtp=1, vocab=101, share=1, down="column")
HIDDEN, HEADS, FFN = 64, 4, 80  # the MoE is megatron_deepseek.moe_config's
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 32, 32, 16, 8, 16
INDEX_HEADS, INDEX_HEAD_DIM, TOPK = 4, 16, 4  # top 4 of 8 tokens: the indexer decides what later queries see
TOKENS = (3, 17, 42, 5, 99, 64, 8, 71)  # a multiple of TP: sequence parallelism splits it


class TorchNorm:
    """torch's LayerNorm / RMSNorm, which megatron-core refuses under sequence parallelism (training would need its
    gradients reduced over TP); a forward normalises each token alone, whatever rank holds it. A class, as
    build_module returns a plain function uncalled."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kw):
        import dataclasses

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return WrappedTorchNorm(dataclasses.replace(config, sequence_parallel=False), hidden_size, eps, **kw)


def local_backend():
    """The local spec provider with the `linear()` DSA asks for (modelopt's Linear, replicated over TP, whose
    sharded tensors name the TP group, so the ranks' equal copies are replicas of one tensor) and norms that run
    under sequence parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class ReplicatedLinear(Linear):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, sharded_offsets=sharded_offsets,
                tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])

    # AbsorbedMLASelfAttention accepts as down projections the linear classes it names, modelopt's Linear among
    # them, but not a subclass: its name there is this one
    absorbed_mla.Linear = ReplicatedLinear

    class Backend(LocalSpecProvider):
        def linear(self):
            return ReplicatedLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
            return TorchNorm

    return Backend()


def transformer_config(a: Namespace):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=a.layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, tensor_model_parallel_size=a.tp, sequence_parallel=a.tp > 1,
        expert_model_parallel_size=a.ep, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        init_method_std=0.05, mtp_num_layers=a.mtp or None,
        multi_latent_attention=True, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE,
        qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, qk_layernorm=True, rope_type="rope", rotary_base=10000,
        rotary_scaling_factor=1.0,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=INDEX_HEADS, dsa_indexer_head_dim=INDEX_HEAD_DIM,
        dsa_indexer_topk=TOPK, dsa_indexer_topk_freq=a.share, dsa_indexer_rotate_activation=False,
        dsa_indexer_rope_interleaved=a.arch == "glm_moe_dsa",
        # DeepSeek-V3.2 limits routing to groups (scored by their top 2 experts, as HF does: topk 2 / 1 group);
        # GLM-5 routes over one group
        **(dict(moe_router_num_groups=2, moe_router_group_topk=1) if a.arch == "deepseek_v32" else {}),
        **moe_config(a))


def hf_config(a: Namespace):
    import transformers

    kw = dict(vocab_size=a.vocab, hidden_size=HIDDEN, num_hidden_layers=a.layers, num_attention_heads=HEADS,
              num_key_value_heads=HEADS, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
              intermediate_size=FFN, moe_intermediate_size=MOE_FFN, n_shared_experts=1,
              n_routed_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
              routed_scaling_factor=2.5, first_k_dense_replace=a.dense, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, index_topk=TOPK,
              index_head_dim=INDEX_HEAD_DIM, index_n_heads=INDEX_HEADS,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if a.arch == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig(n_group=1, topk_group=1, indexer_types=indexer_types(a), **kw)
    return transformers.DeepseekV32Config(n_group=2, topk_group=1, **kw)


def indexer_types(a: Namespace) -> list[str]:
    """GLM-5's per-layer indexers as megatron-core places them: with `share` > 1, "shared" layers reuse the top-k
    of the last layer whose indexer ran, and hold no indexer."""
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer

    return ["shared" if a.share > 1 and is_dsa_skip_topk_layer(i + 1, 0, a.share) else "full"
            for i in range(a.layers)]


def build_model(a: Namespace, config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    backend = local_backend()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        if a.down == "column":
            attention.linear_q_down_proj = attention.linear_kv_down_proj = ColumnParallelLinear
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm)
    mtp = get_gpt_mtp_block_spec_for_backend(config, block, backend) if a.mtp else None
    torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=padded_vocab(a.vocab, a.tp),
                     max_sequence_length=64, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=10000, parallel_output=False, mtp_block_spec=mtp).eval()
    randomise(model)
    return model


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep)
    model = build_model(a, transformer_config(a))
    save_legacy(a, [model], out / "legacy")
    save_dist(a, [model], out / "dist")
    oracle = forward(a, model, TOKENS)
    if a.mtp:
        oracle["mtp_params"] = mtp_params(model)
    if dist.get_rank() == 0:
        torch.save(oracle, out / "logits.pt")
        write_save_dirs(out, hf_config(a))
    dist.barrier()
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = parse(DEFAULTS, "arch: deepseek_v32 or glm_moe_dsa; ep: expert-parallel size; "
                       "dense: how many first layers have a dense MLP; share: glm_moe_dsa's indexer runs on every "
                       "share-th layer, the others reuse its choice; down: column (column-parallel q/kv down "
                       "projections) or linear (the DSA spec's own, whole on every rank)",
                       fixed=dict(pp=1, vpp=None, tied=False))
    cpu_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
