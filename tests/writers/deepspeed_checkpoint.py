"""Write real DeepSpeed ZeRO checkpoints of tiny Llama models with DeepSpeed itself, on CPU under gloo (torchrun).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 -m tests.writers.deepspeed_checkpoint --out ROOT

Each case trains one step and saves into ROOT/NAME/ what its layout holds:
- `engine` cases: `engine.save_checkpoint(ROOT/NAME/out, tag="global_step1")` (the output dir: `latest`,
  `zero_to_fp32.py`, `global_step1/`) and ROOT/NAME/hf/ (config + tokenizer, no weights);
- the `trainer` case: HF Trainer with a DeepSpeed config, saving ROOT/NAME/out/checkpoint-1/ (config.json,
  tokenizer, `global_step1/`, `latest`).
Rank 0 then writes the oracle ROOT/NAME/reference.pt: DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_tokenizer, save_hf_folder, tiny_config

# name: (zero stage, bf16, tied embeddings, frozen module, written by HF Trainer)
CASES = {
    "s2_fp32_frozen": (2, False, False, True, False),
    "s2_bf16_tied": (2, True, True, False, False),
    "s3_fp32_tied_frozen": (3, False, True, True, False),
    "s3_bf16_frozen": (3, True, False, True, False),
    "trainer_s1_bf16": (1, True, False, True, True),
}
SEQ = 6
BUFFER = "model.merge_check"


def ds_config(stage: int, bf16: bool) -> dict:
    # Stage 3 splits each param group into sub-groups of about sub_group_size elements, one flat fp32 tensor
    # each: small ones here, so the partitions come in several tensors.
    zero = {"stage": stage, **({"sub_group_size": 2000} if stage == 3 else {})}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}


def freeze(model) -> None:
    """A frozen module (as when a tower is kept fixed): its params become DeepSpeed's frozen params."""
    model.model.layers[0].mlp.requires_grad_(False)


def build(stage: int, tied: bool, frozen: bool, cfg: dict):
    import deepspeed
    import transformers

    torch.manual_seed(0)
    config = tiny_config("llama", tied=tied)
    if stage == 3:  # stage 3 partitions each param as it is created
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(config)
    if frozen:
        freeze(model)
    # A persistent buffer (Llama has none): DeepSpeed lists it in buffer_names and saves it in module whole.
    model.model.register_buffer(BUFFER.split(".", 1)[1], torch.arange(7.0) / 2)
    return model


def param_groups(model) -> list[dict]:
    """Two groups, as HF Trainer makes them: matrices with weight decay, vectors (norms) without."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    is_vector = [len(getattr(p, "ds_shape", p.shape)) < 2 for p in trainable]  # stage 3: p itself is empty
    return [{"params": [p for p, v in zip(trainable, is_vector) if not v]},
            {"params": [p for p, v in zip(trainable, is_vector) if v], "weight_decay": 0.0}]


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randint(0, 101, (1, SEQ), generator=g)


def engine_case(folder: Path, stage: int, bf16: bool, tied: bool, frozen: bool) -> None:
    import deepspeed

    cfg = ds_config(stage, bf16)
    model = build(stage, tied, frozen, cfg)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    tokens = batch()
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    if dist.get_rank() == 0:
        save_hf_folder(model, folder / "hf")
    engine.save_checkpoint(str(folder / "out"), tag="global_step1")
    dist.barrier()


def trainer_case(folder: Path, stage: int, bf16: bool, tied: bool, frozen: bool) -> None:
    import transformers

    cfg = ds_config(stage, bf16)
    cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    args = transformers.TrainingArguments(
        output_dir=str(folder / "out"), use_cpu=True, deepspeed=cfg, bf16=bf16, max_steps=1, save_steps=1,
        per_device_train_batch_size=1, learning_rate=1e-2, report_to=[], logging_strategy="no",
        save_strategy="steps", disable_tqdm=True, optim="adamw_torch")
    model = build(stage, tied, frozen, cfg)
    model.config.architectures = [type(model).__name__]
    tokens = batch()
    data = [{"input_ids": tokens[0], "labels": tokens[0]}]
    transformers.Trainer(model=model, args=args, train_dataset=data, processing_class=build_tokenizer()).train()
    dist.barrier()


def write_reference(folder: Path, trainer: bool) -> None:
    """DeepSpeed's own fp32 reconstruction (zero_to_fp32), the oracle the merge is compared with."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = folder / "out" / "checkpoint-1" if trainer else folder / "out"
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    torch.save({k: v.contiguous().clone() for k, v in state.items()}, folder / "reference.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    args = p.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(args.out / "torch_extensions"))
    import deepspeed

    # The CPU accelerator compiles a shared-memory all-reduce op on first use (about 100 s on 2 cores); gloo
    # alone does the collectives of a one-step tiny model, so it is marked unavailable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    for name in args.case or CASES:
        stage, bf16, tied, frozen, trainer = CASES[name]
        folder = args.out / name
        (trainer_case if trainer else engine_case)(folder, stage, bf16, tied, frozen)
        if dist.get_rank() == 0:
            write_reference(folder, trainer)
        dist.barrier()
    leave_group()


if __name__ == "__main__":
    main()
