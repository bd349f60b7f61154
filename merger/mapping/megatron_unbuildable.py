"""HF model types whose Megatron training needs modules that megatron-core (0.19.2) does not have, each with the short
reason, so a Megatron checkpoint claiming one stops on that reason rather than on 'no Megatron mapping' and the list of
every known type. Megatron-Bridge builds these modules itself; merger has no record of the layout they save, because
no such checkpoint could be written here to test one against (docs/megatron.md says what each lacks in full)."""
from __future__ import annotations

# Step-3.7's text model is Step-3.5's (config model_type step3p5). Megatron-Bridge's Step-3.5/3.7 need Megatron-LM's
# dev branch for the head-wise gate; on a core without it the bridge fakes the gate with attention_output_gate (every
# channel gated), which after training is not a per-head gate, so that fallback is no layout to read either.
_STEP3P7 = ("its head-wise attention gate is not in megatron-core 0.19.2: Megatron-Bridge's Step-3.5 and 3.7 need "
            "Megatron-LM's dev branch for it")
_GEMMA4 = ("megatron-core 0.19.2 has none of Gemma 4's norms after attention and MLP, head_dim and key-value heads per "
           "layer type, shared key-values, per-layer input embeddings, dense MLP beside the experts under a router "
           "with its own norm and scales, or logit softcapping: Megatron-Bridge builds them itself, and merger does "
           "not map that layout yet")

_DEEPSEEK_V4 = ("megatron-core 0.19.2 has neither its hybrid compressed attention (Megatron-Bridge's dsv4_hybrid), nor "
                "its hyper-connections, nor its hash-routed layers: Megatron-Bridge's DeepSeek-V4 asks for all three")

UNBUILDABLE = {"step3p7": _STEP3P7, "step3p5": _STEP3P7, "gemma4": _GEMMA4, "gemma4_text": _GEMMA4,
               "deepseek_v4": _DEEPSEEK_V4}
