"""LoRA adapters on a megatron-core GPTModel, laid out and saved as Megatron-Bridge's LoRA does (for
megatron_checkpoint.py's `lora=R` cases), so that Megatron's own forward with them live is the oracle.

Megatron-Bridge (0.3.1) wraps each target linear in a LoRALinear: the base linear, plus a ParallelLinearAdapter
whose `linear_in` is a RowParallelLinear (input_is_parallel) when the base layer's input is split (linear_proj,
linear_fc2) and a ColumnParallelLinear with gather_output otherwise, and whose `linear_out` is a
ColumnParallelLinear (gathering its output for a row-parallel base); the output is base + (alpha / dim) *
linear_out(linear_in(x)). Its sharded state keeps the base under the linear's own prefix and the adapter under
`<linear>.adapter.linear_in.` / `.linear_out.`, with fc1's linear_out split into gate and up as fc1's weight is.
Megatron-Bridge imports Transformer Engine, which a CPU-only torch cannot, so this is that module rebuilt from
megatron-core's own parallel layers and sharding helpers.
"""
from __future__ import annotations

import zlib

import torch

TARGETS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # their input is split over TP


class LoraLinear(torch.nn.Module):
    def __init__(self, base, config, rank: int, alpha: float, name: str):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.to_wrap, self.scale, self.fc1 = base, alpha / rank, name.endswith("linear_fc1")
        row = name.endswith(ROW_PARALLEL)

        def init(part: str):  # nonzero both sides (Megatron-Bridge starts linear_out at zero), equal on every rank
            seed = zlib.crc32(f"{name}.{part}".encode())
            return lambda w: w.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))

        if row:
            self.linear_in = RowParallelLinear(base.input_size, rank, config=config, init_method=init("in"),
                                               bias=False, input_is_parallel=True, skip_bias_add=True)
        else:
            self.linear_in = ColumnParallelLinear(base.input_size, rank, config=config, init_method=init("in"),
                                                  bias=False, gather_output=True)
        self.linear_out = ColumnParallelLinear(rank, base.output_size, config=config, init_method=init("out"),
                                               bias=False, gather_output=row)

    def forward(self, x, *args, **kwargs):
        out, bias = self.to_wrap(x, *args, **kwargs)
        low, _ = self.linear_in(x)
        delta, _ = self.linear_out(low)
        return out + self.scale * delta, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        state = self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.linear_in.sharded_state_dict(f"{prefix}adapter.linear_in.", sharded_offsets, metadata))
        out = self.linear_out.sharded_state_dict(f"{prefix}adapter.linear_out.", sharded_offsets, metadata)
        if self.fc1:
            key = f"{prefix}adapter.linear_out.weight"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        state.update(out)
        return state


def attach(chunks: list, config, rank: int, alpha: float) -> None:
    """Wrap every target linear of every layer, each adapter seeded by its layer and linear."""
    for vp, chunk in enumerate(chunks):
        for i, layer in enumerate(chunk.decoder.layers):
            for target in TARGETS:
                owner_name, linear = target.split(".")
                owner = getattr(layer, owner_name)
                wrapped = LoraLinear(getattr(owner, linear), config, rank, alpha,
                                     f"{vp}.{layer.layer_number}.{target}")
                setattr(owner, linear, wrapped)


def save_adapter_shards(chunks: list, path) -> None:
    """The model's sharded state filtered to the adapter, as verl saves it for a LoRA run with Megatron-Bridge."""
    from megatron.core import dist_checkpointing

    state = {}
    for i, chunk in enumerate(chunks):
        full = chunk.sharded_state_dict()
        state[f"model{i}" if len(chunks) > 1 else "model"] = {k: v for k, v in full.items() if ".adapter." in k}
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(path))
