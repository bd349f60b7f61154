"""Write megatron-core MoE checkpoints in each expert layout, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 4 -m tests.writers.megatron_moe_checkpoint --out ROOT \
        --case grouped:arch=qwen3_moe,tp=2,ep=2,etp=1,grouped=1,cross=1

The cases, the model and ROOT/NAME/{legacy,dist,hf,logits.pt} are megatron_checkpoint.py's (pp=1, no virtual
pipeline here), with these keys on top:
- grouped=1: experts as GroupedMLP (`moe_grouped_gemm` with the local spec: legacy `experts.weight1/weight2`).
  grouped_gemm does not build without CUDA: its `gmm` is stood in for by a loop over experts.
- etp=N: expert tensor parallel size (default: tp). Legacy files exist for the (TP, EP) pairs of expert-DP
  rank 0 only, as Megatron-LM writes them (TP2 EP2 ETP1: `mp_rank_00_000` and `mp_rank_01_001`).
- te=1: legacy expert keys renamed to TEGroupedMLP's (`mlp.experts.linear_fc1.weight{i}`, local i), which
  Transformer Engine writes and which cannot be built on CPU.
- dense_first=1: `moe_layer_freq` [0, 1, ...]: layer 0 dense (HF `mlp_only_layers`), per-layer torch_dist keys.
- cross=1: the torch_dist save loaded into a SequentialMLP model of the same layout, its forward logits in
  ROOT/NAME/logits_sequential.pt: a check of the oracle that does not go through the `gmm` stand-in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import types
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

from tests.writers import megatron_checkpoint as mc
from tests.writers.leave_group import leave_group

EXTRA = dict(grouped=0, etp=None, te=0, dense_first=0, cross=0)


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm.ops.gmm: rows of `a` in runs of batch_sizes, run i multiplied by b[i]."""
    outs, start = [], 0
    for i, n in enumerate(batch_sizes.tolist()):
        outs.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
        start += n
    return torch.cat(outs)


def grouped_gemm_patch() -> None:
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    module = types.ModuleType("grouped_gemm")
    module.ops = types.SimpleNamespace(gmm=gmm)
    gg.grouped_gemm, gg.ops = module, module.ops


def transformer_config(a: Namespace, grouped: bool):
    layers = [0] + [1] * (a.layers - 1) if a.dense_first else 1
    return dataclasses.replace(mc.transformer_config(a), moe_grouped_gemm=grouped,
                               expert_tensor_parallel_size=a.etp, moe_layer_freq=layers)


@contextlib.contextmanager
def block_spec(config):
    """megatron_checkpoint.build_chunks asks gpt_layer_specs for a layer spec: it gets the decoder block spec
    of `config` (GroupedMLP or SequentialMLP experts, dense layers where moe_layer_freq says) instead."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    saved = specs.get_gpt_layer_local_spec
    specs.get_gpt_layer_local_spec = lambda **kw: spec
    try:
        yield
    finally:
        specs.get_gpt_layer_local_spec = saved


def build(a: Namespace, config) -> list:
    with block_spec(config):
        return mc.build_chunks(a, config)


# TEGroupedMLP keeps one GroupedLinear per fc, whose state dict names expert i's weight `weight{i}`
# (megatron/core/transformer/moe/experts.py, TEGroupedMLP.sharded_state_dict: `f'{name}.weight{i}'`), and holds
# one `_extra_state` per fc.
SEQUENTIAL = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)")


def te_names(state: dict) -> dict:
    def renamed(key: str) -> str:
        m = SEQUENTIAL.fullmatch(key)
        if not m:
            return key
        leaf = "_extra_state" if m.group(4) == "_extra_state" else f"weight{m.group(2)}"
        return f"{m.group(1)}{m.group(3)}.{leaf}"

    return {renamed(k): v for k, v in state.items()}


def save_legacy(a: Namespace, chunk, root: Path) -> None:
    """Megatron-LM's `--ckpt-format torch` save: expert-DP rank 0 writes `mp_rank_{tp}_{ep}` (checkpointing.py)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_data_parallel_rank() != 0:
        return
    state = chunk.state_dict_for_save_checkpoint()
    args = Namespace(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
                     expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp, num_experts=a.experts,
                     moe_grouped_gemm=bool(a.grouped), num_layers=a.layers,
                     padded_vocab_size=mc.padded_vocab(a.vocab, a.tp), untie_embeddings_and_output_weights=not a.tied)
    path = root / "iter_0000001" / mc.legacy_dir(ps.get_tensor_model_parallel_rank(), 0,
                                                 ps.get_expert_model_parallel_rank(), a) / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": te_names(state) if a.te else state, "args": args, "checkpoint_version": 3.0,
                "iteration": 1}, path)


def sequential_logits(a: Namespace, config, dist_dir: Path, tokens: torch.Tensor):
    """Megatron's logits from a SequentialMLP model that loaded the torch_dist save."""
    from megatron.core import dist_checkpointing

    seq_config = dataclasses.replace(config, moe_grouped_gemm=False, bf16=False)
    (chunk,) = build(a, seq_config)
    chunk.load_state_dict(dist_checkpointing.load(chunk.sharded_state_dict(), str(dist_dir / "iter_0000001")))
    return mc.forward_logits(a, [chunk], tokens)


def write_case(a: Namespace, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(a.tp, 1, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    config = transformer_config(a, bool(a.grouped))
    chunks = build(a, config)
    save_legacy(a, chunks[0], out / "legacy")
    mc.save_dist(a, chunks, out / "dist")
    config.bf16 = bool(a.grouped)  # GroupedMLP.forward asserts it; the parameters stay fp32
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64, 8]])
    outputs = {"logits.pt": mc.forward_logits(a, chunks, tokens)}
    if a.cross:
        dist.barrier()  # every rank's part of the torch_dist save is written
        outputs["logits_sequential.pt"] = sequential_logits(a, config, out / "dist", tokens)
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        for name, logits in outputs.items():
            torch.save({"tokens": tokens, "logits": logits}, out / name)
    if dist.get_rank() == 0:
        for fmt in ("legacy", "dist"):
            (out / fmt / "latest_checkpointed_iteration.txt").write_text("1")
        hf = mc.hf_config(a, config)
        if a.dense_first:
            hf.mlp_only_layers = [0]
        hf.architectures = [type(hf).__name__.replace("Config", "ForCausalLM")]
        hf.save_pretrained(out / "hf")
        mc.build_tokenizer().save_pretrained(out / "hf")
    dist.barrier()
    ps.destroy_model_parallel()


def main() -> None:
    out, cases = mc.parse()
    mc.cpu_patches()
    grouped_gemm_patch()
    dist.init_process_group("gloo")
    for name, a in cases:
        for key, value in EXTRA.items():
            setattr(a, key, getattr(a, key, value))
        a.etp = a.etp or a.tp
        write_case(a, out / name)
    leave_group()


if __name__ == "__main__":  # dist_checkpointing.save starts a spawn-context Manager, which re-imports __main__
    main()
