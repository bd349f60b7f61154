"""Write GLM-4.5V Megatron checkpoints with megatron-core 0.19.2, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_glm45v --out ROOT --case glm45v:tp=2,ep=2

Megatron-Bridge trains GLM-4.5V as its GLM45VModel: a GPTModel (GLM-4.5's text model) as `language_model` and HF's
own Glm4vMoe vision module as `visual`, saved under HF's names and whole on every rank (shared/FORMATS.md). Its
provider imports Megatron-Bridge's provider machinery (omegaconf and more), which the writer venv leaves out (it has
the bridge without its dependencies, for megatron_qwen3_vl.py's model code); this writer builds the same layout:
- `language_model`: a GPTModel on megatron-core's local spec as GLM-4.5's (GQA with qkv bias, half-rotary heads,
  RMSNorm, a dense first layer, then a sigmoid router whose expert bias steers the choice, top-k weights
  renormalised and scaled, one shared expert: megatron_moe_renames.py's moe_config), with GLM-4.5V's multimodal
  RoPE (`mrope`, the t/h/w sections of transformers' mrope_section), at TP `tp` and EP `ep` with expert TP 1, its
  vectors and experts drawn from their global names so EP ranks' experts differ (megatron_gpt_oss_minimax.py);
- `visual`: transformers' Glm4vMoeVisionModel (taken from a Glm4vMoeModel, whose get_rope_index gives the image's
  positions), every rank drawing it alike, its matrices scaled up, norms and biases moved off 1 and 0.
Saved by megatron_checkpoint.py's write_model (legacy/, dist/; hf/ with Glm4vMoeConfig, a tokenizer with the vision
tokens and a chat template). The oracle logits.pt holds: Megatron's own logits on text tokens; the tower's state
dict under HF's names (`model.visual.*`); and a text+image forward: pixel patches through the HF tower, its
merged output put in place of the image tokens' embeddings in Megatron's language model, positions from
transformers' get_rope_index, with the tokens, pixels, grid and token types that give transformers the same input.
"""
from __future__ import annotations

import zlib
from argparse import Namespace
from pathlib import Path

import torch

from tests.writers import megatron_gpt_oss_minimax as oss_minimax
from tests.writers.megatron_checkpoint import cpu_patches, parse, write_cases, write_model
from tests.writers.megatron_gpt_oss_minimax import EXPERTS
from tests.writers.megatron_moe_renames import FFN, HEAD_DIM, HIDDEN, MOE_FFN, SCALE, TOPK, block_spec, moe_config
from tests.writers.megatron_qwen3_vl import TOKEN_IDS, image_inputs, save_vlm_folder

DEFAULTS = dict(tp=2, ep=2, layers=2, dense=1, heads=4, groups=2, vocab=101)
ROTARY = 0.5  # GLM's rotary on half of each head: 8 of 16 channels, 4 frequencies
MROPE = [2, 1, 1]  # of those 4 frequencies, the temporal, height and width positions' (HF's mrope_section)
V_HIDDEN, V_HEADS, V_DEPTH, V_FFN, PATCH, FRAMES, CHANNELS, MERGE, IMAGE = 32, 4, 2, 24, 4, 2, 3, 2, 16
GRID = (1, 4, 4)  # the image's patches (t, h, w): 2 x 2 tokens after merging
TEXT = [3, 17, 42, 5, 99, 64, 8]
IMAGE_TOKEN = TOKEN_IDS["<|image_pad|>"]


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    kw = moe_config(a, [0] * a.dense + [1] * (a.layers - a.dense))
    return TransformerConfig(add_qkv_bias=True, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=SCALE,
                             moe_shared_expert_intermediate_size=MOE_FFN, mrope_section=MROPE, **kw)


def hf_config(a: Namespace):
    import transformers

    text = dict(vocab_size=a.vocab, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.groups,
                head_dim=HEAD_DIM, n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOPK,
                first_k_dense_replace=a.dense, norm_topk_prob=True, routed_scaling_factor=SCALE, n_group=1,
                topk_group=1, rms_norm_eps=1e-5, attention_bias=True, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY,
                                 "mrope_section": MROPE})
    vision = dict(depth=V_DEPTH, hidden_size=V_HIDDEN, intermediate_size=V_FFN, num_heads=V_HEADS,
                  out_hidden_size=HIDDEN, patch_size=PATCH, temporal_patch_size=FRAMES, spatial_merge_size=MERGE,
                  image_size=IMAGE, in_channels=CHANNELS, attention_bias=True)
    start, end = TOKEN_IDS["<|vision_start|>"], TOKEN_IDS["<|vision_end|>"]
    return transformers.Glm4vMoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=IMAGE_TOKEN,
        video_token_id=TOKEN_IDS["<|video_pad|>"], image_start_token_id=start, image_end_token_id=end,
        video_start_token_id=start, video_end_token_id=end)


def _hf_model(a: Namespace):
    """transformers' Glm4vMoeModel, drawn alike on every rank: its tower is the checkpoint's, its get_rope_index the
    image's positions. The tower's matrices are scaled up from transformers' init (std 0.02), under which its
    output is too small to move the logits: a mapping error in it would then pass the text+image check."""
    import transformers

    torch.manual_seed(4321)
    model = transformers.Glm4vMoeModel(hf_config(a)).eval()
    with torch.no_grad():
        for name, p in model.visual.named_parameters():
            if p.dim() > 1:
                p.mul_(5)
            else:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1)
    return model


def _classes():
    from megatron.core.transformer.module import MegatronModule

    class GLM45VModel(MegatronModule):
        """Megatron-Bridge's layout: the GPTModel as `language_model`, HF's vision module as `visual`."""

        def __init__(self, language_model, visual):
            super().__init__(language_model.config)
            self.language_model, self.visual = language_model, visual

    return GLM45VModel


def _logits(a: Namespace, language_model, tokens, positions, image=None):
    """Megatron's logits, `image` (the tower's merged output) in place of the image tokens' embeddings."""
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        embedded = None
        if image is not None:
            embedded = language_model.embedding(input_ids=tokens, position_ids=None).clone()  # [s, b, h]
            embedded[tokens[0] == IMAGE_TOKEN, 0] = image
        return language_model(tokens, positions, mask, decoder_input=embedded)[..., :a.vocab]


def _oracle(a: Namespace, model, hf) -> dict:
    text = torch.tensor([TEXT])
    inputs = image_inputs(GRID, CHANNELS * FRAMES * PATCH * PATCH, MERGE)
    tokens, grid = inputs["image_tokens"], inputs["image_grid"]
    with torch.no_grad():
        image = hf.visual(inputs["image_pixels"], grid_thw=grid).pooler_output
        positions, _ = hf.get_rope_index(tokens, inputs["image_token_types"], image_grid_thw=grid)
    return dict(inputs, tokens=text,
                logits=_logits(a, model.language_model, text, torch.arange(len(TEXT)).expand(3, 1, -1)),
                image_logits=_logits(a, model.language_model, tokens, positions, image),
                visual={f"model.visual.{k}": v.clone() for k, v in hf.visual.state_dict().items()})


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1)
    config = transformer_config(a)
    language_model = oss_minimax.build_model(a, config, block_spec(a, config), (), position_embedding_type="mrope",
                                             rotary_percent=ROTARY)
    hf = _hf_model(a)
    model = _classes()(language_model, hf.visual)
    write_model(a, model, out, lambda: _oracle(a, model, hf), lambda: hf_config(a))
    if torch.distributed.get_rank() == 0:  # the VLM's own class, tokenizer and chat template over the text model's
        save_vlm_folder(hf_config(a), out / "hf")
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = parse(DEFAULTS, "ep: expert-parallel size (expert TP 1); dense: how many first layers have a dense "
                       "MLP; the vision tower is fixed",
                       fixed=dict(arch="glm4v_moe", pp=1, vpp=None, tied=False, etp=1))
    cpu_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
