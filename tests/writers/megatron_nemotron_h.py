"""Write Nemotron-H Megatron checkpoints (MambaModel: Mamba2 mixers, attention, MLP and MoE layers by the hybrid
pattern) with megatron-core, on CPU under gloo (torchrun).

    PYTHONPATH=MAMBA_SRC torchrun --nproc_per_node 2 -m tests.writers.megatron_nemotron_h --out ROOT \
        --case nemotron_h_tp2:tp=2

megatron-core's MambaMixer needs mamba_ssm, whose pip build fails without CUDA. MAMBA_SRC is the unpacked
mamba-ssm sdist (tests/helpers/mamba_ssm_source.py): its Python source imports once its CUDA extension
(`selective_scan_cuda`, never called here) has a stand-in, and mamba_ssm's own torch references replace its
kernels (`mamba_split_conv1d_scan_ref`, `selective_scan_ref`, `rms_norm_ref`), with a torch causal conv1d for the
`causal_conv1d` package. The layers are megatron-core's local (non-TE) modules; MambaStack's final norm, which
megatron-core 0.16.1 hard-codes as Transformer Engine's TENorm, is torch's RMSNorm.

Every rank builds its slice of one seeded model and saves it as megatron_checkpoint.py does, into ROOT/NAME/:
legacy/ and dist/ (Megatron-LM save dirs), hf/ (transformers' NemotronHConfig and a tokenizer) and logits.pt
("tokens", "logits": Megatron's own forward, sliced to the HF vocab size).
"""
from __future__ import annotations

import sys
import types
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.writers.megatron_deepseek import EXPERTS, MOE_FFN, moe_config
from tests.writers.megatron_checkpoint import (SEQ, cpu_patches, padded_vocab, parse, randomise_vectors, save_dist,
                                               save_legacy, write_cases, write_save_dirs)

DEFAULTS = dict(arch="nemotron_h", tp=1, vocab=101)  # the one model type it writes
# Megatron's hybrid pattern: M a Mamba2 layer, * attention, - an MLP, E a MoE (relu2 experts and a shared expert
# behind DeepSeek-V3's router: sigmoid scores whose expert bias steers the choice, top-k normalised then scaled)
PATTERN = "M*M-E"
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, STATE, CONV, CHUNK = 8, 16, 2, 16, 4, 16
EPS = 1e-5  # MambaMixer's gated norm hard-codes 1e-5; HF uses layer_norm_epsilon for every norm


def causal_conv1d(x, weight, bias=None, activation=None):
    """What the causal_conv1d package computes: a depthwise conv over (batch, dim, seq), seeing only the past."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def mamba_patches() -> None:
    sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops import selective_scan_interface
    from mamba_ssm.ops.triton import layernorm_gated, ssd_combined

    selective_scan_interface.selective_scan_fn = selective_scan_interface.selective_scan_ref
    ssd_combined.causal_conv1d_fn = causal_conv1d

    import megatron.core.ssm.mamba_block as mamba_block
    import megatron.core.ssm.mamba_mixer as mamba_mixer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def scan(*args, seq_idx=None, **kw):  # the reference has no packed sequences
        assert seq_idx is None
        return ssd_combined.mamba_split_conv1d_scan_ref(*args, **kw)

    def gated_norm(self, x, z=None):
        return layernorm_gated.rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                                            norm_before_gate=self.norm_before_gate)

    mamba_mixer.mamba_split_conv1d_scan_combined = scan
    mamba_mixer.ExtendedRMSNorm.forward = gated_norm
    mamba_block.TENorm = WrappedTorchNorm


def transformer_config(a: Namespace):
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=len(PATTERN), hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=EPS,
        gated_linear_unit=False, activation_func=squared_relu, add_bias_linear=False,
        mamba_state_dim=STATE, mamba_head_dim=MAMBA_HEAD_DIM, mamba_num_groups=MAMBA_GROUPS,
        mamba_num_heads=MAMBA_HEADS, tensor_model_parallel_size=a.tp, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, init_method_std=0.05, **moe_config(Namespace(dense=0, layers=len(PATTERN))))


def stack_spec():
    """megatron-core's mamba_stack_spec with its local modules in place of Transformer Engine's."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    bda = get_bias_dropout_add
    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                              core_attention=DotProductAttention,
                                                              linear_proj=RowParallelLinear))
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                          linear_fc2=RowParallelLinear))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm, mixer=mixer, mamba_bda=bda)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm, self_attention=attention, self_attn_bda=bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm, mlp=mlp, mlp_bda=bda)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm, mlp=get_moe_module_spec(use_te=False, num_experts=EXPERTS),
            mlp_bda=bda))))


def hf_config(a: Namespace):
    import transformers

    return transformers.NemotronHConfig(
        vocab_size=a.vocab, hidden_size=HIDDEN, hybrid_override_pattern=PATTERN, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=HEAD_DIM, intermediate_size=FFN, mlp_hidden_act="relu2",
        ssm_state_size=STATE, mamba_num_heads=MAMBA_HEADS, mamba_head_dim=MAMBA_HEAD_DIM, n_groups=MAMBA_GROUPS,
        conv_kernel=CONV, chunk_size=CHUNK, layer_norm_epsilon=EPS, max_position_embeddings=64,
        tie_word_embeddings=False, use_bias=False, mlp_bias=False, use_conv_bias=True, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=MOE_FFN, moe_shared_expert_intermediate_size=MOE_FFN,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)


def build_model(a: Namespace, config):
    from megatron.core.models.mamba import MambaModel

    torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
    model = MambaModel(config=config, mamba_stack_spec=stack_spec(), vocab_size=padded_vocab(a.vocab, a.tp),
                       max_sequence_length=64, hybrid_override_pattern=PATTERN, pre_process=True,
                       post_process=True, share_embeddings_and_output_weights=False, parallel_output=False,
                       position_embedding_type="none").eval()
    randomise_vectors([model])  # A_log, D, dt_bias, conv bias and the norms too: every rank's part its own
    with torch.no_grad():  # the expert bias starts at 0 and is a buffer, the same on every rank
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    return model


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp)
    model = build_model(a, transformer_config(a))
    save_legacy(a, [model], out / "legacy")
    save_dist(a, [model], out / "dist")
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64, 8]])
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ)[None], mask)[..., :a.vocab]
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, out / "logits.pt")
        write_save_dirs(out, hf_config(a))
    dist.barrier()
    ps.destroy_model_parallel()


def main() -> None:
    # what save_legacy records in the args: one pipeline stage, untied
    out, cases = parse(DEFAULTS, f"the layers are {PATTERN}", fixed=dict(pp=1, vpp=None, ep=1, layers=len(PATTERN),
                                                                        tied=False))
    cpu_patches()
    mamba_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
