"""Write a multi-GB fp32 DeepSpeed ZeRO-3 checkpoint with DeepSpeed itself, on CPU. Run under torchrun.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/build_deepspeed_checkpoint.py --out DIR --layers 7

The model is built inside `deepspeed.zero.Init`, so each rank only ever holds its partition, and saved
straight after `deepspeed.initialize` (no training step: the optimizer has no moments yet, the files hold the
fp32 partitions, as zero_to_fp32 and merger read them). DIR gets HF Trainer's checkpoint-N layout: `latest`,
`global_step1/`, DeepSpeed's `zero_to_fp32.py`, and config.json, written last.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers

from build_checkpoint import bench_config, size_parser


def main() -> None:
    p = size_parser()
    args = p.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(args.out / "torch_extensions"))
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a 100 s compile gloo does not need
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    config = bench_config(args.layers, args.hidden)
    # The model's module is imported before zero.Init: inside it, DeepSpeed's patched tensor constructors fail the
    # signature check of the torch._dynamo polyfills that transformers' masking_utils imports (torch 2.13).
    model_class = transformers.LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = model_class(config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    engine.save_checkpoint(str(args.out), tag="global_step1")
    dist.barrier()
    if dist.get_rank() == 0:
        config.save_pretrained(args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
