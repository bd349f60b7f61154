"""Write gpt-oss and MiniMax-M2 Megatron checkpoints with megatron-core 0.16.1, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_gpt_oss_minimax --out ROOT --case oss:arch=gpt_oss

Tiny models as the two are built (local spec, every layer MoE over 4 experts, TP 2 and EP 2 with expert TP 1 on
2 ranks by default):
- `arch=gpt_oss`: attention with biases and learnable sinks (`softmax_type="learnable"`, Megatron's
  `core_attention.softmax_offset`), a sliding window on every other layer (the first), a router with a bias
  (softmax over the top k), experts with biases and gpt-oss's clamped GLU (quick-gelu gate, up + 1);
- `arch=minimax_m2`: q/k RMSNorms across all heads (HF's q_norm over heads x head_dim, so the norm's sum of
  squares is summed over the TP ranks here; Megatron's own q/k norms are per head), partial rotary, a sigmoid
  router whose expert bias steers the choice.
Every vector and every expert is then drawn from a seed naming its global tensor (and the rank's slice taken),
so TP halves and EP ranks' experts all differ: the sinks and the full-width norms, which Megatron does not flag
as TP-split, differ between the TP ranks as they would after training. Saved by megatron_checkpoint.py's write_model
(legacy/, dist/, hf/, logits.pt with Megatron's own forward logits: megatron_deepseek.py's oracle), the legacy args
naming expert TP.
"""
from __future__ import annotations

import re
import zlib
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import cpu_patches, padded_vocab, parse, write_cases, write_model
from tests.writers.megatron_deepseek import oracle

DEFAULTS = dict(arch="gpt_oss", tp=2, ep=2, layers=2, heads=4, groups=2, vocab=101, mtp=0)
HIDDEN, HEAD_DIM, MOE_FFN, EXPERTS = 64, 16, 32, 4
WINDOW, LIMIT = 3, 1.0  # HF's sliding_window (tokens seen, itself included); the GLU clamp, low enough to bite
MINIMAX_ROTARY = 0.5
SPLIT_UNFLAGGED = ("core_attention.softmax_offset", "q_layernorm.weight", "k_layernorm.weight")


def sliding_window_on_cpu() -> None:
    """megatron-core 0.16.1 builds the sliding-window mask on "cuda" (shared/FORMATS.md)."""
    from megatron.core.fusions import fused_softmax

    def mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = mask


class FullWidthRMSNorm(torch.nn.Module):
    """MiniMax-M2's q (or k) norm on one TP rank: RMS over every head's channels, the rank's heads' weights.
    SelfAttention builds it as a q/k layernorm (hidden_size = head_dim) and calls it on [s, b, heads, head_dim]."""

    def __init__(self, hidden_size: int, config, eps: float = 1e-6, heads: int = 0):
        from megatron.core import parallel_state as ps

        super().__init__()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.width = heads * hidden_size  # all heads'
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp))

    def forward(self, x):
        from megatron.core import parallel_state as ps

        flat = x.reshape(*x.shape[:2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=ps.get_tensor_model_parallel_group())
        return (self.weight * flat * torch.rsqrt(squares / self.width + self.eps)).reshape(x.shape).to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Split over TP along dim 0, as the heads are (Megatron's default would save rank 0's as the whole)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


def transformer_config(a: Namespace):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=a.layers, hidden_size=HIDDEN, num_attention_heads=a.heads, num_query_groups=a.groups,
        kv_channels=HEAD_DIM, ffn_hidden_size=MOE_FFN, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep,
        expert_tensor_parallel_size=1, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        init_method_std=0.05, num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=2,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False)
    if a.arch == "gpt_oss":  # MoE biases need expert TP 1 (shared/FORMATS.md)
        return TransformerConfig(
            add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable", window_size=(WINDOW - 1, 0),
            window_attn_skip_freq=2, activation_func=quick_gelu, glu_linear_offset=1.0,
            activation_func_clamp_value=LIMIT, **kw)
    return TransformerConfig(add_bias_linear=False, activation_func=F.silu, qk_layernorm=True,
                             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, **kw)


def hf_config(a: Namespace):
    import transformers

    common = dict(vocab_size=a.vocab, hidden_size=HIDDEN, intermediate_size=MOE_FFN, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.groups, head_dim=HEAD_DIM,
                  num_local_experts=EXPERTS, num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=64,
                  tie_word_embeddings=False)
    if a.arch == "gpt_oss":
        return transformers.GptOssConfig(sliding_window=WINDOW, swiglu_limit=LIMIT, attention_bias=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    return transformers.MiniMaxM2Config(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": MINIMAX_ROTARY},
        bos_token_id=None, eos_token_id=None, **common)  # its defaults lie past this vocab


def layer_spec(a: Namespace):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, qk_layernorm=a.arch == "minimax_m2",
                                    normalization="RMSNorm")
    if a.arch == "minimax_m2":
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": a.heads})
        attention.k_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": a.groups})
    return spec


def _draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def distinct_values(model, a: Namespace, split_unflagged: tuple[str, ...] = SPLIT_UNFLAGGED) -> None:
    """Vectors and experts drawn from their global name (the rank's slice of a TP-split one, or of one named in
    `split_unflagged`): norms near 1, sinks and biases around 0, expert matrices at the init's scale."""
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep * EXPERTS // a.ep + int(m[1])}.",
                          name)
            expert = "local_experts." in name
            if p.dim() != 1 and not expert:
                continue
            split = p.dim() == 1 and not expert and (getattr(p, "tensor_model_parallel", False)
                                                     or name.endswith(split_unflagged))
            whole = _draw(name, (p.shape[0] * a.tp, *p.shape[1:]) if split else p.shape)
            value = whole.chunk(a.tp)[tp] if split else whole
            p.copy_(1 + 0.1 * value if "norm" in name else 0.05 * value if p.dim() > 1 else 0.3 * value)


def build_model(a: Namespace, config, spec=None, split_unflagged: tuple[str, ...] = SPLIT_UNFLAGGED, **rope):
    """The model of `spec` (a layer's or a block's; this writer's layer_spec by default), its values drawn apart
    (distinct_values); `rope` overrides GPTModel's position embedding keywords (GLM-4.5V's partial MRoPE)."""
    from megatron.core.models.gpt import GPTModel

    rope = {"position_embedding_type": "rope", "rotary_base": 10000,
            "rotary_percent": MINIMAX_ROTARY if a.arch == "minimax_m2" else 1.0, **rope}
    torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
    model = GPTModel(config=config, transformer_layer_spec=spec or layer_spec(a),
                     vocab_size=padded_vocab(a.vocab, a.tp), max_sequence_length=64, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, parallel_output=False,
                     **rope).eval()
    distinct_values(model, a, split_unflagged)
    with torch.no_grad():  # the expert bias is a buffer, 0 at first: the same on every rank
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(_draw(name, buf.shape) * 0.5)
    return model


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1)
    config = transformer_config(a)
    model = build_model(a, config)
    write_model(a, model, out, lambda: oracle(a, model), lambda: hf_config(a))
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = parse(DEFAULTS, "arch: gpt_oss or minimax_m2; ep: expert-parallel size (expert TP is 1)",
                       fixed=dict(pp=1, vpp=None, tied=False, etp=1))
    cpu_patches()
    sliding_window_on_cpu()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
