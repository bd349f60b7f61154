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
model's logits on text tokens; Megatron-Bridge 0.6.2's own Qwen3VLModel (installed without its dependencies:
requirements312-nodeps.txt), built at the same TP rank and pipeline stage on megatron-core's local modules
(bridge_modules) and given the saved model's tensors under the same names, every one of its own accounted for, on
text and an image (`image_*`: its tower on the pixel patches with their grid, 2D rotary and interpolated position
embeddings, the deepstack mergers' output added into the first text layers, MRoPE positions; pipelined as the text
logits are); and the tower's modules each on its own input: the vision blocks over a patch sequence with a rotary
table given to both sides, each patch merger, the patch embedding over pixel patches.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
from argparse import Namespace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tests.writers.megatron_checkpoint import (SEQ, build_chunks, cpu_patches, forward_logits, layer_spec,
                                               padded_vocab, parse, randomise_vectors, transformer_config,
                                               write_cases, write_model)
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
# the image of the text+image oracle, in patches (t, h, w): 6 x 4 on the 4 x 4 grid of position embeddings, so
# they are interpolated, unevenly in h and w; 3 x 2 tokens after merging
GRID = (1, 6, 4)


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


@functools.cache
def bridge_modules() -> types.SimpleNamespace:
    """Megatron-Bridge 0.6.2's Qwen3-VL modules (models/qwen_vl/modelling_qwen3_vl), set up for CPU as
    shared/FORMATS.md records:
    - imported without running the package __init__s above them: megatron.bridge's imports every model family, and
      some need transformers modules 5.24 removed (the writer venv's transformers is 5.24);
    - Qwen3VLModel builds its tower from Transformer Engine modules, which have no CPU build: the names it builds
      them by point at megatron-core's local ones (the local ViT layer spec, a torch LayerNorm, Column/RowParallel
      linears), which hold the same tensors under the same names;
    - the bridge's attention off TE (local core attention, no packed sequence) masks causally whatever the layer's
      mask type; the ViT layers' is no_mask (TE's kernel attends both ways there, as HF's tower does): honoured;
    - the tower packs its images one sequence a frame for TE's kernels; the oracle's one single-frame image is one
      sequence, which the local attention takes whole, unpacked."""
    import megatron.core
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    root = Path(megatron.core.__file__).parent.parent / "bridge"
    for folder in ("", "models", "models/qwen_vl", "models/qwen_vl/modelling_qwen3_vl"):
        name = ".".join(["megatron.bridge", *filter(None, folder.split("/"))])
        package = types.ModuleType(name)
        package.__path__ = [str(root / folder)]
        sys.modules[name] = package
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *a, **k: None  # CPU torch has no NVTX
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import attention, model, transformer_config, vision_model

    class SelfAttention(attention.Qwen3VLSelfAttention):
        def _local_causal_attention(self, query, key, value, scale):
            if self.attn_mask_type != AttnMaskType.no_mask:
                return super()._local_causal_attention(query, key, value, scale)
            scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * scale  # a query group per head
            context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1).to(value.dtype), value)
            return context.reshape(context.shape[0], context.shape[1], -1)

    def one_sequence(self, grid_thw):
        assert grid_thw.shape[0] == 1 and grid_thw[0, 0] == 1, "one single-frame image"
        return None

    model.get_vit_layer_with_transformer_engine_spec = get_vit_layer_with_local_spec
    model.TENorm, model.TEColumnParallelLinear, model.TERowParallelLinear = (WrappedTorchNorm, ColumnParallelLinear,
                                                                            RowParallelLinear)
    model.Qwen3VLSelfAttention = SelfAttention
    vision_model.Qwen3VLVisionModel.build_packed_seq_params = one_sequence
    return types.SimpleNamespace(Qwen3VLModel=model.Qwen3VLModel, SelfAttention=SelfAttention,
                                 Qwen3VLTransformerConfig=transformer_config.Qwen3VLTransformerConfig)


def bridge_model(a: Namespace, saved, specs: dict, hf):
    """Megatron-Bridge's own Qwen3VLModel of this rank's slice (its TP rank, its pipeline stage: the tower on the
    first alone), the text model on `specs` (Qwen3VLModel's keywords for the specs `saved`'s text model was built on:
    its layers' or block's, an MTP block's), the tower of HF config `hf`'s vision_config, holding the tensors of
    `saved` (the VLM the checkpoint was saved from): the same names, each of its tensors given one and none left
    over."""
    from megatron.core import parallel_state as ps

    bridge = bridge_modules()
    text = saved.language_model.config
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text) if f.init}
    rope = hf.text_config.rope_parameters
    fields.update(vocab_size=padded_vocab(a.vocab, a.tp), spatial_merge_size=MERGE, rotary_base=rope["rope_theta"],
                  rotary_percent=rope.get("partial_rotary_factor", 1.0), mrope_section=rope["mrope_section"],
                  image_token_id=hf.image_token_id, video_token_id=hf.video_token_id,
                  vision_start_token_id=hf.vision_start_token_id)
    for spec in specs.values():
        _standard_attention_is(spec, bridge.SelfAttention)
    model = bridge.Qwen3VLModel(bridge.Qwen3VLTransformerConfig(**fields), vision_transformer_config=hf.vision_config,
                                parallel_output=False, pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage(), **specs).eval()
    theirs, ours = model.state_dict(), saved.state_dict()
    assert theirs.keys() == ours.keys(), sorted(theirs.keys() ^ ours.keys())
    model.load_state_dict(ours, strict=True)
    if model.vision_model is not None:
        # The bridge's patch mergers apply the tower's activation, tanh-approximated GELU, where HF's Qwen3-VL
        # mergers (and this writer's) have exact GELU: a difference of the bridge's model, not of any mapping, that
        # alone moves these logits up to 1.0e-4 from transformers' (measured), as much as the test's tolerance.
        # The oracle takes HF's, so a mapping error is not hidden under it (the rest agrees within 6e-6).
        for merger in (model.vision_model.merger, *model.vision_model.decoder.deepstack_merger_list):
            merger.activation_func = F.gelu
    return model


def _standard_attention_is(spec, attention) -> None:
    """`attention` as the module of every standard self-attention in `spec`, where Megatron-Bridge puts its
    Qwen3VLSelfAttention (MRoPE applied its way): Qwen3VLModel does it to a layer spec, the bridge's Qwen3.5 provider
    to each attention layer of a block spec (not a Gated DeltaNet) and of an MTP block's layers
    (qwen35_vl_provider._patch_standard_attention_specs, whose module needs omegaconf and more to import)."""
    from megatron.core.transformer.attention import SelfAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = getattr(layer, "submodules", None)
        if hasattr(sub, "mtp_model_layer"):
            _standard_attention_is(sub.mtp_model_layer, attention)
        module = getattr(getattr(sub, "self_attention", None), "module", None)
        if isinstance(module, type) and issubclass(module, SelfAttention):
            sub.self_attention.module = attention


def image_inputs(grid: tuple[int, int, int], width: int, merge: int) -> dict:
    """Text around one image of `grid` patches (t, h, w) as HF's processor lays it out (the vision start, an image
    pad per `merge` x `merge` patches, the vision end), its token types, and pixel patches `width` values each, drawn
    alike on every rank (megatron_glm45v.py's too)."""
    start, end, pad = (TOKEN_IDS[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    patches = grid[0] * grid[1] * grid[2]
    tokens = torch.tensor([[3, 17, start] + [pad] * (patches // merge ** 2) + [end, 42, 5]])
    pixels = torch.randn(patches, width, generator=torch.Generator().manual_seed(7))
    return dict(image_tokens=tokens, image_token_types=(tokens == pad).int(), image_grid=torch.tensor([grid]),
                image_pixels=pixels)


def image_logits(a: Namespace, model, inputs: dict) -> dict:
    """`inputs` and Megatron-Bridge's Qwen3VLModel's logits on them (None but on the last stage): its own forward,
    the tower on the pixel patches with their grid, its merged output in place of the image pads, the deepstack
    mergers' added to the first text layers' output there, MRoPE positions from its get_rope_index."""
    tokens = inputs["image_tokens"]

    def run(chunk):
        return chunk(tokens, pixel_values=inputs["image_pixels"], image_grid_thw=inputs["image_grid"])

    return dict(inputs, image_logits=forward_logits(a, [model], tokens, run))


def oracle(model, text: Callable[[], dict], image: Callable[[], dict]) -> dict | None:
    """Megatron's own forwards, on inputs every rank draws alike: the language model's (`text()`: its tokens and
    logits, at least), the whole VLM's on text and an image (`image()`), the tower's modules. With
    pipeline stages, the tower's outputs are the first stage's and the logits the last's: both are gathered to the
    last stage, which returns them (None elsewhere)."""
    from megatron.core import parallel_state as ps

    found = text()  # collective: every stage runs its part of the forward
    found.update(image())  # collective too
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
              lambda: text_logits(a, language_model), lambda: text_specs(a, language_model.config))
    ps.destroy_model_parallel()


def text_specs(a: Namespace, config) -> dict:
    """The spec the writer's text model is built on, anew, as Qwen3VLModel's keyword: Qwen3's layer spec
    (build_chunks'), Qwen3-VL-MoE's block spec (a dense first layer)."""
    return dict(language_transformer_layer_spec=block_spec(a, config) if a.arch == MOE else layer_spec(a))


def write_vlm(a: Namespace, language_model, out_hidden: int, deepstack: tuple[int, ...], out: Path, hf,
              text: Callable[[], dict], specs: Callable[[], dict]) -> None:
    """The VLM of `language_model` and the tower (deepstack mergers after the `deepstack` blocks), saved with its
    oracle (`text()`: the language model's; Megatron-Bridge's Qwen3VLModel's text+image forward over the same tensors,
    its text model on `specs()`, the specs the language model was built on as Qwen3VLModel's keywords) and the HF
    VLM's config folder (megatron_qwen3_5_vl.py's too). With pipeline stages the tower is the first stage's alone,
    whole, as Megatron-Bridge's Qwen3VLModel builds it (only where pre_process, its vision config at PP 1): the other
    stages save the text model's layers and no tower."""
    from megatron.core import parallel_state as ps

    vision_class, model_class = vision_classes()
    vision_model = None
    if ps.is_pipeline_first_stage():
        torch.manual_seed(4321)  # every rank draws the tower alike, then keeps its TP slice
        vision_model = vision_class(vision_config(a), out_hidden, deepstack).eval()
        randomise_vectors([vision_model])
    model = model_class(language_model.config, language_model, vision_model)

    def image() -> dict:
        inputs = image_inputs(GRID, CHANNELS * FRAMES * PATCH * PATCH, MERGE)
        return image_logits(a, bridge_model(a, model, specs(), hf()), inputs)

    write_model(a, model, out, lambda: oracle(model, text, image), hf)
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
