"""Write a real torchtitan DCP checkpoint and its oracles. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.torchtitan_checkpoint --out DIR --hf HF --reference REF
    torchrun --nproc_per_node 2 -m tests.writers.torchtitan_checkpoint --family qwen3_moe --out DIR --hf HF \
        --logits LOGITS

Every rank builds the same seeded tiny torchtitan model, shards it with `fully_shard` and `dcp.save`s
`model.state_dict()` into OUT, as torchtitan's checkpointer writes `checkpoint/step-N/`. Rank 0 writes the HF
config of the same shape to HF (torchtitan checkpoints carry none) and an oracle:
- llama (`Llama3Model`, GQA: 4 query heads, 2 kv heads): REF, torchtitan's own `Llama3StateDictAdapter.to_hf` of
  the unsharded state dict;
- qwen3 (`Qwen3Model`, dense: qk-norm, GQA), qwen3_moe (the same with MoE layers: 4 experts, top 2) and deepseek_v3 (`DeepSeekV3Model`: MLA
  with q-LoRA, a dense first layer, then MoE with a sigmoid router, a routing bias and a shared expert): LOGITS,
  torchtitan's own forward of the unsharded model on TOKENS (torchtitan's to_hf is not an oracle for every family);
- qwen3_5_text / qwen3_5_moe_text (`Qwen35Model`: a Gated DeltaNet layer, then a gated full-attention one; the MoE
  variant with a gated shared expert; its vision tower) and kimi_k2_7 (`KimiK25Model`: the deepseek_v3 model above
  with a MoonViT vision tower): LOGITS on text TOKENS, with the HF config of the text model (Qwen3.5's needs FLA
  importable; see gated_deltanet_on_cpu); with --hf-vlm and --vision the HF VLM's config (qwen3_5, kimi_k25) and
  the vision tower's features on seeded patches, and for kimi_k2_7 with --reference torchtitan's own to_hf (the
  names of Moonshot's Kimi-K2.5 release).
"""
from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.writers.leave_group import leave_group

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, THETA = 32, 4, 2, 2, 101, 72, 10000.0
HEAD_DIM, EXPERTS, TOP_K, MOE_FFN = 8, 4, 2, 24
TOKENS = [[1, 5, 7, 9, 11, 3, 42, 100]]


def titan_config():
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=llama3._build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=128, theta=THETA, scaling="none")),
    )


def qwen3_titan_config(moe: bool = True):
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm

    shape = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, attn_backend="flex",
                 rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=128, theta=THETA))
    layers = (qwen3._build_qwen3_moe_layers(moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=TOP_K,
                                            moe_comm_backend="standard", **shape) if moe
              else qwen3._build_qwen3_layers(hidden_dim=FFN, **shape))
    return qwen3.Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=1e-6),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    )


def qwen3_hf_config():
    import transformers

    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=THETA,
        max_position_embeddings=128, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])


def qwen3_moe_hf_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=THETA, max_position_embeddings=128,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])


DS_Q_LORA, DS_KV_LORA, DS_NOPE, DS_ROPE, DS_V, DS_SHARED, DS_DENSE_FFN = 16, 16, 8, 4, 8, 1, 48


def deepseek_v3_titan_config(mtp: int = 0):
    from torchtitan.models import deepseek_v3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    config = deepseek_v3.DeepSeekV3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=deepseek_v3._build_dsv3_layers(  # a dense first layer, then MoE with a shared expert
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=DS_Q_LORA,
            kv_lora_rank=DS_KV_LORA, qk_nope_head_dim=DS_NOPE, qk_rope_head_dim=DS_ROPE, v_head_dim=DS_V, mscale=1.0,
            dense_hidden_dim=DS_DENSE_FFN, moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, num_shared_experts=DS_SHARED,
            router_top_k=TOP_K, router_score_func="sigmoid", router_route_norm=True, attn_backend="flex",
            moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=DS_ROPE, max_seq_len=128, theta=THETA, scaling="none")),
        mtp_layers=[],
    )
    config.mtp_layers = deepseek_v3._build_mtp_layers(config.layers[-1], dim=DIM, num_mtp_layers=mtp)
    return config


def deepseek_v3_hf_config():
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=DS_DENSE_FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=DS_SHARED,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=DS_Q_LORA, kv_lora_rank=DS_KV_LORA,
        qk_nope_head_dim=DS_NOPE, qk_rope_head_dim=DS_ROPE, v_head_dim=DS_V, rope_interleave=True,
        rope_theta=THETA, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"])


# Qwen3.5: a Gated DeltaNet layer then a gated full-attention layer (full_attention_interval 2), and the vision
# tower torchtitan's Qwen3.5 always builds (tiny: one block)
QW_LAYERS, QW_ROTARY, QW_KEY_HEADS, QW_VALUE_HEADS, QW_SHARED_FFN = 2, 4, 2, 4, 16


def qwen3_5_titan_config(moe: bool = False):
    from torchtitan.models import qwen3_5
    from torchtitan.models.common import Embedding, Linear

    shape = dict(n_layers=QW_LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                 rotary_dim=QW_ROTARY, n_key_heads=QW_KEY_HEADS, n_value_heads=QW_VALUE_HEADS, key_head_dim=HEAD_DIM,
                 value_head_dim=HEAD_DIM, full_attention_interval=2, attn_backend="flex",
                 rope=qwen3_5.MRoPE.Config(dim=QW_ROTARY, max_seq_len=128, theta=THETA, mrope_section=[1, 1, 0]))
    layers = (qwen3_5._build_qwen35_moe_layers(moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=TOP_K,
                                               shared_expert_hidden_dim=QW_SHARED_FFN, **shape) if moe
              else qwen3_5._build_qwen35_layers(hidden_dim=FFN, **shape))
    return qwen3_5.Qwen35Model.Config(
        dim=DIM, vocab_size=VOCAB, norm=qwen3_5._offset_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers,
        vision_encoder=qwen3_5._qwen35_vision_encoder_config(
            dim=16, ffn_dim=32, num_layers=1, num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
            out_hidden_size=DIM, num_position_embeddings=16))


def qwen3_5_hf_config(moe: bool = False):
    import transformers

    shape = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=QW_LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, linear_conv_kernel_dim=4,
                 linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_num_key_heads=QW_KEY_HEADS,
                 linear_num_value_heads=QW_VALUE_HEADS, layer_types=["linear_attention", "full_attention"],
                 rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": THETA,
                                  "partial_rotary_factor": QW_ROTARY / HEAD_DIM, "mrope_section": [1, 1, 0],
                                  "mrope_interleaved": True})
    if moe:
        return transformers.Qwen3_5MoeTextConfig(
            moe_intermediate_size=MOE_FFN, shared_expert_intermediate_size=QW_SHARED_FFN, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, architectures=["Qwen3_5MoeForCausalLM"], **shape)
    return transformers.Qwen3_5TextConfig(intermediate_size=FFN, architectures=["Qwen3_5ForCausalLM"], **shape)


QW_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
                 temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=DIM, num_position_embeddings=16)
VISION_GRID = [[1, 4, 4]]  # one image of 4 x 4 patches


def qwen3_5_vlm_config(moe: bool = False):
    """The HF VLM (qwen3_5 / qwen3_5_moe) of the same text model, with the vision tower torchtitan builds."""
    import transformers

    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return cls(text_config=qwen3_5_hf_config(moe).to_dict(), vision_config=QW_VISION, tie_word_embeddings=False,
               architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"])


def qwen3_5_vision_features(model) -> dict:
    """torchtitan's vision tower on seeded patches of VISION_GRID, its block mask built eagerly (as its flex
    attention runs, eager_flex_attention)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.qwen3_5 import vision_encoder

    vision_encoder.compiled_create_block_mask = create_block_mask
    grid = torch.tensor(VISION_GRID)
    torch.manual_seed(1)
    patches = torch.randn(int(grid.prod()), 3 * 2 * 2 * 2)  # C x T x P x P per patch, QW_VISION's
    with torch.no_grad():
        features = model.vision_encoder(patches[None], grid_thw=grid)[0]
    return {"patches": patches, "grid": grid, "features": features}


def gated_deltanet_on_cpu() -> None:
    """Run torchtitan's Gated DeltaNet on CPU: its kernel through FLA's own pure-torch reference (FLA's kernels are
    Triton, GPU only; the kernel torchtitan calls normalizes q and k inside, use_qk_l2norm_in_kernel, as here), and
    its causal conv on one whole sequence (no document offsets: their varlen conv is FLA's Triton too), which
    torchtitan's spmd_types annotation refuses, so the unsharded forward runs under its partial_dtensor backend."""
    from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3_5 import model

    set_spmd_backend("partial_dtensor")

    def l2norm(x):
        return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6).to(x.dtype)

    def kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens=None, cu_seqlens_cpu=None):
        assert use_qk_l2norm_in_kernel and cu_seqlens is None
        return naive_recurrent_gated_delta_rule(l2norm(q), l2norm(k), v, beta, g)

    model._fla_chunk_gated_delta_rule = kernel


KIMI_VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, patch_size=2,
                   pos_emb_height=4, pos_emb_width=4, merge_kernel_size=[2, 2],
                   rope_parameters={"rope_type": "axial", "rope_theta": THETA})


def kimi_k2_7_titan_config():
    """torchtitan's Kimi-K2.5 / K2.7 (`KimiK25Model`): the DeepSeek-V3 model above with a MoonViT vision tower."""
    import dataclasses

    from torchtitan.models import kimi_k2_7

    text = deepseek_v3_titan_config()
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text) if f.init}
    v = KIMI_VISION
    return kimi_k2_7.KimiK25Model.Config(**fields, vision_encoder=kimi_k2_7._vision_encoder_config(
        dim=v["hidden_size"], ffn_dim=v["intermediate_size"], num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"], patch_size=v["patch_size"], init_pos_emb_height=v["pos_emb_height"],
        init_pos_emb_width=v["pos_emb_width"], rope_theta=THETA, text_hidden_size=DIM))


def kimi_k25_vlm_config():
    """transformers' kimi_k25 (Kimi-K2.5 / K2.6, the VLM) of the same model: the deepseek_v3 text model, the
    MoonViT tower torchtitan builds, its projector's norm over the tower's width."""
    import transformers

    return transformers.Kimi_K25Config(
        text_config=deepseek_v3_hf_config().to_dict(), vision_config=KIMI_VISION,
        projection_hidden_size=KIMI_VISION["hidden_size"], tie_word_embeddings=False,
        architectures=["Kimi_K25ForConditionalGeneration"])


def kimi_k2_7_vision_features(model) -> dict:
    """torchtitan's vision tower and projector on seeded patches of VISION_GRID (its 4 x 4 position table as it
    is), its block mask built eagerly (as its flex attention runs, eager_flex_attention)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.kimi_k2_7 import vision_encoder

    vision_encoder.compiled_create_block_mask = create_block_mask
    grid = torch.tensor(VISION_GRID)
    torch.manual_seed(1)
    side = KIMI_VISION["patch_size"]
    patches = torch.randn(int(grid.prod()), 3 * side * side)  # C x P x P per patch, raster order
    with torch.no_grad():
        features = model.vision_encoder(patches[None], grid_thw=grid)[0]
    return {"patches": patches, "grid": grid, "features": features}


def gpt_oss_titan_config():
    from torchtitan.models import gpt_oss
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm

    return gpt_oss.GptOssModel.Config(  # 64 heads of 64, 8 kv heads: torchtitan's builder fixes them
        vocab_size=VOCAB, dim=DIM, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM), lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=gpt_oss._build_gptoss_layers(
            fuse_qkv=True, dim=DIM, n_layers=LAYERS, hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=TOP_K,
            load_balance_coeff=1e-3, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=64, max_seq_len=128, theta=150000.0)))


def gpt_oss_hf_config():
    import transformers

    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=128, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["GptOssForCausalLM"])


def hf_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                    rms_norm_eps=1e-5, rope_theta=THETA, max_position_embeddings=128,
                                    tie_word_embeddings=False)


def eager_flex_attention() -> None:
    """Run torchtitan's flex attention eagerly: the same function, without torch.compile. On a CPU without AVX-512
    (an AMD EPYC host with AVX2 only), the compiled CPU kernel gave NaN logits on its first call and other values on
    the next, which made the oracle itself wrong; eagerly the logits are the same call after call."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex_attention


def seeded_model(config):
    """The torchtitan model of `config` with seeded values everywhere (norms too), the same on every rank, its
    attention run eagerly (eager_flex_attention)."""
    eager_flex_attention()
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--family", choices=["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5_text",
                                        "qwen3_5_moe_text", "kimi_k2_7"], default="llama")
    p.add_argument("--reference", type=Path, help="llama, kimi_k2_7: torchtitan's own to_hf output")
    p.add_argument("--logits", type=Path, help="torchtitan's own logits on TOKENS (with MTP: a list, main first)")
    p.add_argument("--mtp", type=int, default=0, help="deepseek_v3: multi-token-prediction layers")
    p.add_argument("--hf-vlm", type=Path, help="qwen3_5, kimi_k2_7: the HF VLM config of the same model, with its "
                                               "vision tower")
    p.add_argument("--vision", type=Path, help="qwen3_5, kimi_k2_7: torchtitan's vision tower output on seeded "
                                               "patches")
    args = p.parse_args()

    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.kimi_k2_7.state_dict_adapter import KimiK25StateDictAdapter
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    titan, hf = {"llama": (titan_config, hf_config), "qwen3": (partial(qwen3_titan_config, moe=False), qwen3_hf_config),
                 "qwen3_moe": (qwen3_titan_config, qwen3_moe_hf_config),
                 "deepseek_v3": (deepseek_v3_titan_config, deepseek_v3_hf_config),
                 "gpt_oss": (gpt_oss_titan_config, gpt_oss_hf_config),
                 "qwen3_5_text": (qwen3_5_titan_config, qwen3_5_hf_config),
                 "qwen3_5_moe_text": (partial(qwen3_5_titan_config, moe=True), partial(qwen3_5_hf_config, moe=True)),
                 "kimi_k2_7": (kimi_k2_7_titan_config, deepseek_v3_hf_config)}[args.family]
    config = titan(args.mtp) if args.mtp else titan()
    if args.family.startswith("qwen3_5"):
        gated_deltanet_on_cpu()
    model = seeded_model(config)
    if args.family == "gpt_oss":  # its experts compute in bf16 (grouped mm): a bf16 model
        model = model.to(torch.bfloat16)
    with torch.no_grad():
        if args.family in ("qwen3_5_text", "qwen3_5_moe_text", "kimi_k2_7"):  # a sharp vision attention: with
            for name, param in model.vision_encoder.named_parameters():  # 0.1's its q and k could be swapped unseen
                if ".attn.wq." in name or ".attn.wk." in name:
                    param.mul_(20)
        if args.family in ("deepseek_v3", "kimi_k2_7"):  # a routing bias that changes which experts are chosen
            for name, buffer in model.named_buffers():
                if name.endswith("expert_bias_E"):
                    buffer.copy_(torch.randn_like(buffer) * 0.1)
    if rank == 0:
        hf().save_pretrained(args.hf)
        kimi = args.family == "kimi_k2_7"
        if args.hf_vlm:
            vlm = kimi_k25_vlm_config() if kimi else qwen3_5_vlm_config(moe=args.family == "qwen3_5_moe_text")
            vlm.save_pretrained(args.hf_vlm)
        if args.vision:
            torch.save((kimi_k2_7_vision_features if kimi else qwen3_5_vision_features)(model.eval()), args.vision)
        if args.reference:
            adapter = KimiK25StateDictAdapter if kimi else Llama3StateDictAdapter
            oracle = adapter(config, None).to_hf(model.state_dict())
            args.reference.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in oracle.items()}, args.reference / "model.safetensors")
        if args.logits:
            tokens = torch.tensor(TOKENS)
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            masks, text = model.get_attention_masks(positions), {}
            if args.family.startswith("qwen3_5"):  # one sequence: the Gated DeltaNet reads it whole (no offsets)
                masks["deltanet"] = None
                text = {"special_tokens": {"image_id": -1, "video_id": -1}}  # text only: no image placeholder
            with torch.no_grad():
                logits = model.eval()(tokens, positions=positions, attention_masks=masks, **text)
            torch.save(logits, args.logits)

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=args.out)
    leave_group()


if __name__ == "__main__":
    main()
