"""Write a multi-GB fp32 Megatron Qwen3.5-MoE checkpoint with megatron-core itself, on CPU. Run under torchrun, 2 ranks.

    torchrun --nproc_per_node 2 benchmarks/build_megatron_qwen35_checkpoint.py --out DIR --layers 4

A Qwen3.5-MoE-shaped GPTModel (HF `qwen3_5_moe_text`): three Gated DeltaNet layers, then one of gated full
attention, repeated; every layer's MLP routed experts (SequentialMLP, one linear pair per expert) and a shared
expert behind its gate. TP2 EP2 ETP1, saved in Megatron-LM's legacy format (`--ckpt-format torch`): DIR gets
`latest_checkpointed_iteration.txt`, `iter_0000001/mp_rank_00_000` and `mp_rank_01_001` (the experts of each EP
rank whole, attention, Gated DeltaNet and the shared expert split by TP), and `huggingface/config.json` (written
last), where merger finds the HF config. The model is the test writer's (tests/writers/megatron_gdn.py, with its
CPU patches), saved by megatron_checkpoint.py's save_legacy; only the sizes differ, in Qwen3.5-35B-A3B's
proportions: head dim 256 with 2 KV groups, Gated DeltaNet heads of 128 (twice as many value heads as key
heads), experts of hidden / 4. At hidden 2048 a layer holds ~136M parameters (32 experts of 512) plus 131M of
embeddings: 4 layers ~ 2.7 GB fp32, 8 layers ~ 4.9 GB.
"""
from __future__ import annotations

import dataclasses
import sys
from argparse import Namespace
from pathlib import Path

import torch.distributed as dist

# the test writers are modules of the repository's tests.writers package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.writers import megatron_checkpoint as mc
from tests.writers import megatron_gdn as gdn

from build_checkpoint import finish_megatron_save, size_parser  # benchmarks/, the script's own folder

PATTERN = "lllf"  # Qwen3.5's full_attention_interval 4: three Gated DeltaNet layers, then full attention


def scale(hidden: int) -> None:
    """The writer's size constants, scaled to `hidden` (heads and key heads at least 2: TP 2 splits them)."""
    heads = max(2, hidden // 128)
    gdn.HIDDEN, gdn.HEADS, gdn.GROUPS, gdn.HEAD_DIM = hidden, heads, 2, 256
    gdn.KEY_HEADS, gdn.VALUE_HEADS, gdn.KEY_DIM, gdn.VALUE_DIM = heads, 2 * heads, 128, 128
    gdn.EXPERTS, gdn.MOE_FFN, gdn.SHARED_FFN = 32, hidden // 4, hidden // 4
    # gdn.FFN, the dense MLP's width, stays: every layer is MoE, it only reaches config.json


def case(layers: int) -> Namespace:
    return Namespace(**{**gdn.DEFAULTS, "arch": "qwen3_5_moe_text", "tp": 2, "ep": 2, "etp": 1, "moe": 1,
                        "pattern": (PATTERN * layers)[:layers], "layers": layers, "vocab": 32000, "vpp": None,
                        "tied": False})


def main() -> None:
    args = size_parser().parse_args()
    mc.cpu_patches()
    gdn.gdn_patches()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    scale(args.hidden)
    a = case(args.layers)
    ps.initialize_model_parallel(a.tp, 1, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    config = dataclasses.replace(gdn.transformer_config(a), expert_tensor_parallel_size=a.etp)
    mc.save_legacy(a, [gdn.build(a, config)], args.out)
    hf = gdn.hf_config(a)
    hf.architectures = ["Qwen3_5MoeForCausalLM"]
    finish_megatron_save(args.out, hf)


if __name__ == "__main__":
    main()
