"""Write a multi-GB fp32 Megatron MoE checkpoint with megatron-core itself, on CPU. Run under torchrun, 2 ranks.

    torchrun --nproc_per_node 2 benchmarks/build_megatron_moe_checkpoint.py --out DIR --layers 6

A Qwen3-MoE-shaped GPTModel with GroupedMLP experts (grouped GEMM, as verl's Megatron MoE recipes train),
TP2 EP2 ETP1, saved in Megatron-LM's legacy format (`--ckpt-format torch`): DIR gets
`latest_checkpointed_iteration.txt`, `iter_0000001/mp_rank_00_000` and `mp_rank_01_001` (the experts of
each EP rank whole, attention split by TP), and `huggingface/config.json` (written last), where merger finds
the HF config. The model is built and saved by the test writers (tests/writers/megatron_moe_checkpoint.py,
megatron_checkpoint.py) with their CPU patches; only the sizes differ. At hidden 2048 a layer holds ~86M
parameters (16 experts of 768) plus 131M of embeddings: 6 layers ~ 2.6 GB fp32.
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
from tests.writers import megatron_moe_checkpoint as moe

from build_checkpoint import finish_megatron_save, size_parser  # benchmarks/, the script's own folder

EXPERTS = 16


def case(layers: int, hidden: int) -> Namespace:
    heads = hidden // 128
    return Namespace(**{**mc.DEFAULTS, **moe.EXTRA, "arch": "qwen3_moe", "tp": 2, "ep": 2, "etp": 1, "grouped": 1,
                        "layers": layers, "heads": heads, "groups": max(1, heads // 4), "vocab": 32000,
                        "experts": EXPERTS})


def main() -> None:
    p = size_parser()
    args = p.parse_args()
    mc.cpu_patches()
    moe.grouped_gemm_patch()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    a = case(args.layers, args.hidden)
    ps.initialize_model_parallel(a.tp, 1, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    # The writers' tiny model, scaled: head dim 128, dense FFN 11/4 x hidden (unused: every layer is MoE),
    # experts of 3/8 x hidden as Qwen3-MoE's.
    moe_ffn = args.hidden * 3 // 8
    config = dataclasses.replace(moe.transformer_config(a, grouped=True), hidden_size=args.hidden, kv_channels=128,
                                 ffn_hidden_size=args.hidden * 11 // 4, moe_ffn_hidden_size=moe_ffn)
    (chunk,) = moe.build(a, config)
    moe.save_legacy(a, chunk, args.out)
    hf = mc.hf_config(a, config)
    hf.moe_intermediate_size = moe_ffn
    hf.architectures = ["Qwen3MoeForCausalLM"]
    finish_megatron_save(args.out, hf)


if __name__ == "__main__":
    main()
