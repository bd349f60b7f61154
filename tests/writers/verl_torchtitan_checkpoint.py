"""Save a torchtitan model where verl's torchtitan engine saves it. Run under torchrun (gloo, CPU).

    torchrun --nproc_per_node 2 -m tests.writers.verl_torchtitan_checkpoint --local_path DIR/global_step_N/actor \
        --step N --hf HF --logits LOGITS

verl's engine (verl/workers/engine/torchtitan/transformer_impl.py) owns a torchtitan Trainer, whose
CheckpointManager holds the model (ModelWrapper: torchtitan's own names), the optimizers, the LR schedulers,
verl's no-op dataloader and the trainer's state (step, tokens seen). Its save_checkpoint(local_path, global_step)
points the manager's folder at dirname(local_path) and calls save(curr_step=global_step): the DCP folder is
`dirname(local_path)/step-N/`, beside `actor/`, not in it (the PPO trainer passes global_step_N/actor, the SFT
trainer global_step_N). Every rank builds the same seeded tiny Qwen3 (the torchtitan family verl maps qwen2 and
qwen3 to), shards it with fully_shard, takes one AdamW step (so the save holds optimizer state) and saves through
torchtitan's CheckpointManager exactly so. Rank 0 writes the HF config to HF (torchtitan saves none) and the
oracle: torchtitan's own forward of the trained model on TOKENS.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.writers.leave_group import leave_group
from tests.writers.torchtitan_checkpoint import TOKENS, qwen3_hf_config, qwen3_titan_config, seeded_model


class NoDataLoader:
    """verl's NoOpDataLoader as the checkpointer sees it: verl brings its own data, the state is empty."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


class TrainState:
    """What torchtitan's Trainer gives the checkpointer as "train_state": the step and the tokens seen."""

    def __init__(self, step: int):
        self.step, self.ntokens_seen = step, 8 * step

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_path", type=Path, required=True, help="what verl passes: global_step_N/actor (PPO) "
                                                                    "or global_step_N (SFT)")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--logits", type=Path, required=True)
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    world = int(os.environ["WORLD_SIZE"])
    model = seeded_model(qwen3_titan_config(moe=False))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # verl's optimizer and scheduler configs, built by torchtitan as the Trainer builds them
    optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW",
        optimizer_kwargs={"lr": 1e-2, "eps": 1e-8, "betas": (0.9, 0.999), "weight_decay": 0.01})],
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
    # A real AdamW step, from set gradients: torch's flex attention (verl's default) has no backward on CPU.
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-2)
    optimizers.step()
    lr_schedulers.step()
    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():  # the trained model's own logits, every rank taking part in FSDP's gathers
        trained = model.eval()(tokens, positions, model.get_attention_masks(positions))
    if dist.get_rank() == 0:
        qwen3_hf_config().save_pretrained(args.hf)
        torch.save(trained, args.logits)

    # verl's CheckpointManager.Config (enable=True; its initial_load_* fields only matter for loading) with
    # interval=1: verl sets none, so torchtitan's default of 500 would skip a save at any other step.
    checkpointer = CheckpointManager.Config(enable=True, interval=1).build(
        dataloader=NoDataLoader(), model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": TrainState(args.step)}, sd_adapter=None)
    checkpointer.folder = os.path.dirname(args.local_path)  # as verl's save_checkpoint does
    checkpointer.save(curr_step=args.step)
    dist.barrier()
    checkpointer.close()
    leave_group()


if __name__ == "__main__":
    main()
