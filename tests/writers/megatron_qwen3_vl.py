"""Write Qwen3-VL Megatron checkpoints with megatron-core 0.19.2, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_qwen3_vl --out ROOT --case qwen3_vl:tp=2 \
        --case moe:arch=qwen3_vl_moe_text,ep=2 --case pp:tp=1,pp=2,layers=4

Megatron-Bridge trains Qwen3-VL as its Qwen3VLModel: a GPTModel (Qwen3's text model) as `language_model` and the
vision tower as `vision_model`, both on Transformer Engine's specs, which have no CPU build (shared/FORMATS.md). This
writer builds the same layout from megatron-core's local modules, as the bridge's models/qwen_vl/modelling_qwen3_vl
lays it out:
- `language_model`: a GPTModel with Qwen3's local spec (q/k norms, RMSNorm, gated SiLU MLP; megatron_checkpoint.py's),
  or with `arch=qwen3_vl_moe_text` Qwen3-VL-MoE's: a dense first layer (mlp_only_layers), then 4 experts behind a
  softmax router whose top-k weights are renormalised, EP `ep` with expert TP 1 (megatron_moe_renames.py's
  moe_config, values drawn apart per global name so the EP ranks' experts differ);
- `vision_model.patch_embed.proj` (a Conv3d over [C, T, P, P] patches), `vision_model.pos_embed` (an Embedding);
- `vision_model.decoder`: a TransformerBlock of megatron-core's ViT layers (get_vit_layer_with_local_spec: LayerNorms,
  bidirectional attention with a query group per head, so linear_qkv is per head [q; k; v], biased linears, a
  tanh-GELU MLP), column- and row-parallel over TP;
- `vision_model.decoder.deepstack_merger_list.N` and `vision_model.merger`: patch mergers (`patch_norm`, a
  column-parallel linear_fc1, GELU, a row-parallel linear_fc2; the deepstack ones normalise after merging 2x2
  patches, the final one before).
With `pp` stages (Qwen3's text model), the text model is pipelined as any GPTModel (the first stage holds the
embedding, the last the final norm and output layer, each its layers numbered from 0 in the legacy files) and the
tower is built on the first stage alone, as the bridge's Qwen3VLModel does (pre_process; its vision config at PP 1).
Saved by megatron_checkpoint.py's write_model (legacy/, dist/, hf/ with Qwen3VLConfig or Qwen3VLMoeConfig, a
tokenizer with the vision tokens and a chat template; the test adds Qwen2-VL's image processor, which needs
torchvision and PIL, absent from the writer venv). The oracle logits.pt holds Megatron's own forwards: the language
model's logits on text tokens; the vision blocks over a patch sequence with a rotary table given to both
sides; each patch merger on its own input; the patch embedding over pixel patches. The tower's whole image path
(2D rotary from the grid, interpolated position embeddings, deepstack injection, MRoPE) is the bridge's code, which
is not rebuilt here: each module the mapping touches is checked through its own forward instead.
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import (SEQ, build_chunks, cpu_patches, forward_logits, parse,
                                               randomise_vectors, transformer_config, write_cases, write_model)
from tests.writers import megatron_gpt_oss_minimax as oss_minimax
from tests.writers.megatron_moe_renames import FFN, HEAD_DIM, HIDDEN, MOE_FFN, TOPK, block_spec, moe_config
from tests.writers.megatron_gpt_oss_minimax import EXPERTS
from tests.writers.tiny_models import VISION_TOKENS, WORDS, build_tokenizer

DEFAULTS = dict(arch="qwen3", tp=2, pp=1, layers=2, ep=1, heads=4, groups=2, vocab=101)
MOE = "qwen3_vl_moe_text"
V_HIDDEN, V_HEADS, V_FFN, V_DEPTH = 32, 4, 48, 2
PATCH, FRAMES, CHANNELS, MERGE, POSITIONS = 4, 2, 3, 2, 16
DEEPSTACK = (0, 1)  # the vision blocks whose output a deepstack merger takes
TEXT_HIDDEN = {"qwen3": 32, MOE: HIDDEN}  # megatron_checkpoint.transformer_config's, megatron_moe_renames.moe_config's
TOKEN_IDS = {tok: len(WORDS) + 2 + i for i, tok in enumerate(VISION_TOKENS)}  # as build_tokenizer(vision=True)
HF_TOKENS = dict(image_token_id=TOKEN_IDS["<|image_pad|>"], video_token_id=TOKEN_IDS["<|video_pad|>"],
                 vision_start_token_id=TOKEN_IDS["<|vision_start|>"], vision_end_token_id=TOKEN_IDS["<|vision_end|>"])
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def vision_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=V_DEPTH, hidden_size=V_HIDDEN, num_attention_heads=V_HEADS, num_query_groups=V_HEADS,
        ffn_hidden_size=V_FFN, kv_channels=V_HIDDEN // V_HEADS, normalization="LayerNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=False, activation_func=lambda x: F.gelu(x, approximate="tanh"), add_bias_linear=True,
        add_qkv_bias=True, tensor_model_parallel_size=a.tp, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        init_method_std=0.05)


def vision_classes():
    """The tower's module (with the deepstack mergers its `deepstack` block numbers ask for: Qwen3.5's has none)
    and the VLM holding it beside the text model."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    class PatchMerger(MegatronModule):
        """2x2 patches merged into one text-width token: the bridge's Qwen3VLVisionPatchMerger's layout."""

        def __init__(self, config, postshuffle: bool, out: int):
            super().__init__(config)
            self.wide, self.postshuffle, self.out = config.hidden_size * MERGE ** 2, postshuffle, out
            self.patch_norm = torch.nn.LayerNorm(self.wide if postshuffle else config.hidden_size, eps=1e-6)
            self.linear_fc1 = ColumnParallelLinear(self.wide, self.wide, config=config, bias=True,
                                                   init_method=config.init_method, gather_output=False)
            self.linear_fc2 = RowParallelLinear(self.wide, out, config=config, bias=True,
                                                init_method=config.output_layer_init_method, input_is_parallel=True,
                                                skip_bias_add=False)

        def forward(self, x):
            x = self.patch_norm(x.view(-1, self.wide) if self.postshuffle else x).view(-1, 1, self.wide)
            h, _ = self.linear_fc1(x)
            out, _ = self.linear_fc2(F.gelu(h))
            return out.view(-1, self.out)

    class Numbered(MegatronModule):
        """A module list whose members save their own TP shards (a plain ModuleList saves as replicated)."""

        def __init__(self, config, modules):
            super().__init__(config)
            for i, module in enumerate(modules):
                self.add_module(str(i), module)

    class PatchEmbed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            kernel = (FRAMES, PATCH, PATCH)
            self.proj = torch.nn.Conv3d(CHANNELS, V_HIDDEN, kernel_size=kernel, stride=kernel, bias=True)

        def forward(self, pixels):
            return self.proj(pixels.view(-1, CHANNELS, FRAMES, PATCH, PATCH)).view(-1, V_HIDDEN)

    class VisionModel(MegatronModule):
        def __init__(self, config, out: int, deepstack: tuple[int, ...]):
            super().__init__(config)
            self.patch_embed = PatchEmbed()
            self.pos_embed = torch.nn.Embedding(POSITIONS, V_HIDDEN)
            self.decoder = TransformerBlock(config, get_vit_layer_with_local_spec(), post_layer_norm=False)
            self.decoder.deepstack_merger_list = Numbered(config, [PatchMerger(config, True, out) for _ in deepstack])
            self.merger = PatchMerger(config, False, out)

    class Qwen3VLModel(MegatronModule):
        def __init__(self, config, language_model, vision_model):
            super().__init__(config)
            self.language_model, self.vision_model = language_model, vision_model

    return VisionModel, Qwen3VLModel


def hf_config(a: Namespace):
    import transformers

    hidden = TEXT_HIDDEN[a.arch]
    head_dim = HEAD_DIM if a.arch == MOE else hidden // a.heads
    text = dict(vocab_size=a.vocab, hidden_size=hidden, intermediate_size=FFN, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.groups, head_dim=head_dim,
                rms_norm_eps=1e-5 if a.arch == MOE else 1e-6, max_position_embeddings=64, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                 "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]})
    if a.arch == MOE:
        text.update(moe_intermediate_size=MOE_FFN, num_experts=EXPERTS, num_experts_per_tok=TOPK, mlp_only_layers=[0],
                    decoder_sparse_step=1)
    vision = dict(hf_vision(hidden), deepstack_visual_indexes=list(DEEPSTACK))
    return (transformers.Qwen3VLMoeConfig if a.arch == MOE else transformers.Qwen3VLConfig)(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **HF_TOKENS)


def hf_vision(out_hidden: int) -> dict:
    """The HF vision_config of the tower vision_config() builds, its merger's output `out_hidden` wide."""
    return dict(depth=V_DEPTH, hidden_size=V_HIDDEN, intermediate_size=V_FFN, num_heads=V_HEADS,
                in_channels=CHANNELS, patch_size=PATCH, temporal_patch_size=FRAMES, spatial_merge_size=MERGE,
                out_hidden_size=out_hidden, num_position_embeddings=POSITIONS)


def _moe_language_model(a: Namespace):
    """Qwen3-VL-MoE's text model: Qwen3-MoE's attention and router, a dense first layer."""
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(qk_layernorm=True, moe_router_score_function="softmax", **moe_config(a, [0, 1]))
    return oss_minimax.build_model(a, config, block_spec(a, config), ())


def text_logits(a: Namespace, language_model) -> dict:
    """The language model's logits on text tokens."""
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64, 8]])
    assert tokens.shape[1] == SEQ
    return dict(tokens=tokens, logits=forward_logits(a, [language_model], tokens))


def oracle(model, text: Callable[[], dict]) -> dict | None:
    """Megatron's own forwards, on inputs every rank draws alike: the language model's (`text()`: its tokens and
    logits, at least), the tower's modules. With pipeline stages, the tower's outputs are the first stage's and the
    logits the last's: both are gathered to the last stage, which returns them (None elsewhere)."""
    from megatron.core import parallel_state as ps

    found = text()  # collective: every stage runs its part of the forward
    if model.vision_model is not None:
        found.update(tower_outputs(model.vision_model))
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return found
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(stages, found, group=ps.get_pipeline_model_parallel_group())
    if not ps.is_pipeline_last_stage():
        return None
    return {k: v for stage in stages for k, v in stage.items() if v is not None}


def tower_outputs(vision) -> dict:
    """The tower's modules' forwards, on inputs drawn alike on every rank that holds it."""
    g = torch.Generator().manual_seed(7)
    patches = 8  # two 2x2 merge groups
    pixels = torch.randn(patches, CHANNELS * FRAMES * PATCH * PATCH, generator=g)
    hidden = torch.randn(patches, V_HIDDEN, generator=g)
    rotary = torch.randn(patches, V_HIDDEN // V_HEADS // 2, generator=g)
    freqs = torch.cat([rotary, rotary], dim=-1)  # megatron-core's (and HF's) rotate-half table, one per patch
    with torch.no_grad():
        blocks = vision.decoder(hidden[:, None], None, rotary_pos_emb=freqs[:, None, None])[:, 0]
        mergers = [m(hidden) for m in (vision.merger, *vision.decoder.deepstack_merger_list.children())]
        embedded = vision.patch_embed(pixels)
    return dict(pixels=pixels, hidden=hidden, freqs=freqs, blocks=blocks, mergers=mergers, embedded=embedded)


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    a.etp = 1 if a.arch == MOE else None  # the legacy files' args: the MoE model's expert TP, none else (TP's)
    ps.initialize_model_parallel(a.tp, a.pp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1)
    language_model = _moe_language_model(a) if a.arch == MOE else build_chunks(a, transformer_config(a))[0]
    write_vlm(a, language_model, TEXT_HIDDEN[a.arch], DEEPSTACK, out, lambda: hf_config(a),
              lambda: text_logits(a, language_model))
    ps.destroy_model_parallel()


def write_vlm(a: Namespace, language_model, out_hidden: int, deepstack: tuple[int, ...], out: Path, hf,
              text: Callable[[], dict]) -> None:
    """The VLM of `language_model` and the tower (deepstack mergers after the `deepstack` blocks), saved with its
    oracle (`text()`: the language model's) and the HF VLM's config folder (megatron_qwen3_5_vl.py's too). With
    pipeline stages the tower is the first stage's alone, whole, as Megatron-Bridge's Qwen3VLModel builds it (only
    where pre_process, its vision config at PP 1): the other stages save the text model's layers and no tower."""
    from megatron.core import parallel_state as ps

    vision_class, model_class = vision_classes()
    vision_model = None
    if ps.is_pipeline_first_stage():
        torch.manual_seed(4321)  # every rank draws the tower alike, then keeps its TP slice
        vision_model = vision_class(vision_config(a), out_hidden, deepstack).eval()
        randomise_vectors([vision_model])
    model = model_class(language_model.config, language_model, vision_model)

    write_model(a, model, out, lambda: oracle(model, text), hf)
    if torch.distributed.get_rank() == 0:  # the VLM's own class, tokenizer and processor files over the text model's
        save_vlm_folder(hf(), out / "hf")


def save_vlm_folder(config, folder: Path) -> None:
    """The HF VLM's config (its ForConditionalGeneration class) and a tokenizer with the vision tokens and a chat
    template, over write_model's text-model folder (megatron_glm45v.py's too)."""
    config.architectures = [type(config).__name__.replace("Config", "ForConditionalGeneration")]
    config.save_pretrained(folder)
    tokenizer = build_tokenizer(vision=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def main() -> None:
    out, cases = parse(DEFAULTS, f"arch: qwen3 (Qwen3-VL's text model) or {MOE} (Qwen3-VL-MoE's); ep: expert-parallel "
                       "size, MoE only (expert TP 1); pp: pipeline stages, qwen3 only (the tower on the first stage); "
                       "the vision tower is fixed",
                       fixed=dict(vpp=None, tied=False, experts=EXPERTS, lora=0, value=0))
    cpu_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
