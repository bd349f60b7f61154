"""Write Qwen3.5 and Qwen3.5-MoE VLM Megatron checkpoints with megatron-core 0.19.2, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 2 -m tests.writers.megatron_qwen3_5_vl --out ROOT --case dense:tp=2 \
        --case moe:arch=qwen3_5_moe_text,moe=1,ep=2

Megatron-Bridge trains Qwen3.5 with its vision tower as the Qwen3VLModel it trains Qwen3-VL as (its
qwen_vl/qwen35_vl_bridge.py): the hybrid text model as `language_model`, Qwen3-VL's tower as `vision_model`, without
deepstack mergers (Qwen3.5's HF tower has none). This writer builds that layout from what the other writers build:
- `language_model`: megatron_gdn.py's Gated DeltaNet hybrid (Gated DeltaNet and gated full attention layers in the
  order `pattern` gives, zero-centred norms; with `moe=1` routed experts and a gated shared expert, EP `ep` with
  expert TP 1), its vectors and experts drawn from their global names (megatron_gpt_oss_minimax.distinct_values) so
  the EP ranks' experts differ;
- `vision_model`: megatron_qwen3_vl.py's tower (patch and position embeddings, ViT blocks with a per-head
  [q; k; v] linear_qkv, the final patch merger, split over TP), no deepstack mergers.
With `mtp=1` the text model has megatron_gdn.py's multi-token-prediction layer (`language_model.mtp.*`).
Saved by megatron_checkpoint.py's write_model (legacy/, dist/, hf/ with Qwen3_5Config or Qwen3_5MoeConfig, a
tokenizer with the vision tokens and a chat template). logits.pt holds Megatron's own forwards as
megatron_qwen3_vl.py's oracle computes them: the language model's logits on text tokens (megatron_gdn.py's forward:
with MTP also its layer's logits and own tensors); Megatron-Bridge's own Qwen3VLModel's on text and an image, over the
saved tensors, its text model on the same block spec (and MTP block spec) as the bridge's Qwen3.5 provider builds it;
the vision blocks, the patch merger and the patch embedding, each on its own input.
"""
from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from tests.writers import megatron_gdn as gdn
from tests.writers.megatron_checkpoint import cpu_patches, parse, write_cases
from tests.writers.megatron_gpt_oss_minimax import distinct_values
from tests.writers.megatron_qwen3_vl import HF_TOKENS, hf_vision, write_vlm

DEFAULTS = dict(arch="qwen3_5_text", tp=2, ep=1, moe=0, pattern="lf", mtp=0, vocab=101)
MOE = "qwen3_5_moe_text"


def hf_config(a: Namespace):
    """The HF VLM's config: megatron_gdn.py's text config, its rotary sections summing to the rotary half-width
    (the text tokens' three position axes are equal, so the split changes nothing they compute)."""
    import transformers

    text = gdn.hf_config(a).to_dict()
    rotary = int(gdn.HEAD_DIM * gdn.ROTARY) // 2
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True,
                                   mrope_section=[rotary - rotary // 2, rotary // 2, 0])
    config = transformers.Qwen3_5MoeConfig if a.arch == MOE else transformers.Qwen3_5Config
    return config(text_config=text, vision_config=hf_vision(gdn.HIDDEN), tie_word_embeddings=False, **HF_TOKENS)


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    a.etp = 1 if a.moe else None  # the experts whole on each EP rank beside TP 2, as Qwen3-VL-MoE's writer has them
    ps.initialize_model_parallel(a.tp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp or a.tp)
    language_model = gdn.build(a, gdn.transformer_config(a))
    # each rank's experts drew the same values from the one seed: draw them (and the vectors) from their global
    # names, so experts taken for one another change the logits
    distinct_values(language_model, a, ())
    config = language_model.config
    write_vlm(a, language_model, gdn.HIDDEN, (), out, lambda: hf_config(a), lambda: gdn.forward(a, language_model),
              lambda: dict(language_transformer_layer_spec=gdn.block_spec(a, config),
                           mtp_block_spec=gdn.mtp_block_spec(a, config)))
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = parse(DEFAULTS, f"arch: qwen3_5_text (Qwen3.5's text model) or {MOE} (Qwen3.5-MoE's, with moe=1); "
                       "pattern: the text layers, l a Gated DeltaNet, f full attention; ep: expert-parallel size; "
                       "mtp: multi-token-prediction layers; the vision tower is fixed",
                       fixed=dict(pp=1, vpp=None, tied=False))
    cpu_patches()
    gdn.gdn_patches()
    for _, a in cases:
        a.layers = len(a.pattern)  # what save_legacy records in the args
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
