"""Write real Megatron checkpoints of a tiny GPT model with megatron-core, on CPU under gloo (torchrun).

    torchrun --nproc_per_node 4 -m tests.writers.megatron_checkpoint --out ROOT \
        --case tp2:arch=qwen2,tp=2 --case pp2:arch=llama,tp=2,pp=2,layers=4,tied=1

Every rank builds its slice of one seeded megatron-core GPTModel (local spec, `use_cpu_initialization`,
so the weights do not depend on the parallel layout), then saves it twice, as Megatron-LM does, into ROOT/NAME/ for each case:
- ROOT/NAME/legacy/: `latest_checkpointed_iteration.txt` + `iter_0000001/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt`
  holding `{"model" | "model0".., "args", "checkpoint_version", "iteration"}` (`--ckpt-format torch`);
- ROOT/NAME/dist/: the same with `iter_0000001/` written by `dist_checkpointing.save` (torch_dist);
- with `lora=R,alpha=A`, ROOT/NAME/lora_dist/iter_0000001/: LoRA adapter shards alone (megatron_lora_adapters.py),
  ROOT/NAME/lora_model_dist/iter_0000001/: the model's shards with its adapter shards, and the logits are those
  of the model with its adapters.
It also writes ROOT/NAME/hf/ (the matching transformers config and a tokenizer, no weights) and the oracle
ROOT/NAME/logits.pt: `{"tokens", "logits"}` from Megatron's own forward pass (pipelined by hand over gloo),
sliced to the HF vocab size.
"""
from __future__ import annotations

import argparse
import contextlib
import zlib
from argparse import Namespace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.writers import megatron_lora_adapters
from tests.writers.leave_group import leave_group
from tests.writers.tiny_models import build_tokenizer

SEQ = 7


def cpu_patches() -> None:
    """What megatron-core 0.16.1 needs to save and run forward on a CPU-only torch (see shared/FORMATS.md)."""
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    mp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None


DEFAULTS = dict(arch="qwen2", tp=1, pp=1, vpp=None, ep=1, layers=2, heads=4, groups=2, vocab=101, tied=False,
                experts=4, optim_only=0, value=0, lora=0, alpha=0)


def parse(defaults: dict = DEFAULTS, about: str = "arch: llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe; "
          "groups 1 = MQA; vocab is HF's, padded to 128 x tp; optim_only: a torch_dist save without model tensors; "
          "value: a critic with a 1-output head; lora=R,alpha=A: LoRA adapters of rank R on every layer's linears, "
          "saved alone as Megatron-Bridge does into lora_dist/, the logits with them live", fixed: dict | None = None
          ) -> tuple[Path, list[tuple[str, Namespace]]]:
    """--out and the --case NAME:key=value,... specs over `defaults` (strings as given, booleans 0/1, the rest ints),
    each with `fixed` added."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", required=True,
                   help="NAME:key=value,... over " + ", ".join(f"{k}={v}" for k, v in defaults.items()) + f" ({about})")
    args = p.parse_args()
    cases = []
    for spec in args.case:
        name, _, pairs = spec.partition(":")
        values = dict(defaults)
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            flag = isinstance(defaults.get(key), bool)
            values[key] = value if isinstance(defaults.get(key), str) else value == "1" if flag else int(value)
        cases.append((name, Namespace(**values, **(fixed or {}))))
    return args.out, cases


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = 128 * tp  # Megatron-LM's make_vocab_size_divisible_by (128) times TP
    return -(-vocab // multiple) * multiple


MOE = ("qwen2_moe", "mixtral", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")
QKV_BIAS = ("qwen2", "qwen2_moe")


def transformer_config(a: Namespace):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=a.layers, hidden_size=32, num_attention_heads=a.heads, num_query_groups=a.groups,
        ffn_hidden_size=40, kv_channels=32 // a.heads, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=a.arch in QKV_BIAS,
        qk_layernorm=a.arch in QK_NORM, tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp, expert_model_parallel_size=a.ep,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, init_method_std=0.05,
    )
    if a.arch in MOE:
        # Qwen2-MoE routes on softmax over all experts (pre-softmax, no renormalisation); Mixtral and
        # Qwen3-MoE (norm_topk_prob) renormalise the top k, which is a softmax over the top-k logits.
        kw.update(num_moe_experts=a.experts, moe_router_topk=2, moe_ffn_hidden_size=24,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_permute_fusion=False, moe_router_pre_softmax=a.arch == "qwen2_moe", moe_aux_loss_coeff=0.0)
    if a.arch == "qwen2_moe":
        kw.update(moe_shared_expert_intermediate_size=36, moe_shared_expert_gate=True)
    return TransformerConfig(**kw)


def hf_config(a: Namespace, config):
    import transformers

    common = dict(vocab_size=a.vocab, hidden_size=config.hidden_size, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.groups, rms_norm_eps=1e-6,
                  max_position_embeddings=64, tie_word_embeddings=a.tied, rope_theta=10000.0)
    moe = dict(num_experts_per_tok=2, intermediate_size=config.ffn_hidden_size)
    if a.arch == "llama":
        return transformers.LlamaConfig(intermediate_size=config.ffn_hidden_size, **common)
    if a.arch == "mistral":
        return transformers.MistralConfig(intermediate_size=config.ffn_hidden_size, **common)
    if a.arch == "qwen2":
        return transformers.Qwen2Config(intermediate_size=config.ffn_hidden_size, **common)
    if a.arch == "qwen3":
        return transformers.Qwen3Config(intermediate_size=config.ffn_hidden_size, head_dim=config.kv_channels,
                                        attention_bias=False, **common)
    if a.arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=a.experts, **dict(moe, intermediate_size=24), **common)
    if a.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=a.experts, moe_intermediate_size=24, norm_topk_prob=True,
                                           head_dim=config.kv_channels, decoder_sparse_step=1, mlp_only_layers=[],
                                           attention_bias=False, **moe, **common)
    return transformers.Qwen2MoeConfig(num_experts=a.experts, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=36, norm_topk_prob=False,
                                       decoder_sparse_step=1, mlp_only_layers=[], **moe, **common)


class ValueHead(torch.nn.Linear):
    """A critic's head as verl builds it: a replicated Linear(hidden, 1) in place of the output layer,
    accepting the output layer's call arguments."""

    def forward(self, x, weight=None, runtime_gather_output=None):
        return super().forward(x), None


def layer_spec(a: Namespace):
    """The local layer spec of `a.arch`'s GPTModel."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=a.experts if a.arch in MOE else None,
                                    qk_layernorm=a.arch in QK_NORM, normalization="RMSNorm")


def build_chunks(a: Namespace, config) -> list:
    """This rank's model chunks (one, or `vpp` with a virtual pipeline), built from one seed."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(a)
    chunks = []
    for vp in range(a.vpp or 1):
        vp_stage = vp if a.vpp else None
        torch.manual_seed(1234)  # CPU init draws each full weight from this seed, then keeps this rank's slice
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=padded_vocab(a.vocab, a.tp),
            max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=a.tied, position_embedding_type="rope", rotary_base=10000,
            parallel_output=False, vp_stage=vp_stage).eval())
    if a.value and chunks[-1].post_process:
        torch.manual_seed(99)  # the same head on every TP rank, as a replicated layer
        chunks[-1].output_layer = ValueHead(config.hidden_size, 1, bias=False)
    randomise_vectors(chunks)
    return chunks


def randomise_vectors(chunks: list) -> None:
    """Norms start at 1 and biases at 0: randomise them so a mix-up cannot go unnoticed. The seed names the
    stage and chunk, and the TP rank for TP-split tensors, so replicated copies stay equal."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for vp, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters():
                if param.dim() == 1:
                    tp = ps.get_tensor_model_parallel_rank() if getattr(param, "tensor_model_parallel", False) else -1
                    seed = zlib.crc32(f"{ps.get_pipeline_model_parallel_rank()}.{vp}.{tp}.{name}".encode())
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)


def legacy_dir(tp: int, pp: int, ep: int, a: Namespace) -> str:
    name = f"mp_rank_{tp:02d}"
    if a.pp > 1:
        name += f"_{pp:03d}"
    if a.ep > 1:
        name += f"_{ep:03d}"
    return name


def save_legacy(a: Namespace, chunks: list, root: Path) -> None:
    from megatron.core import parallel_state as ps

    tp, pp, ep = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    # Megatron-LM: one file per (TP, PP, EP) slice, written by the first data-parallel replica of its experts.
    if (ps.get_expert_data_parallel_rank() if a.ep > 1 else ps.get_data_parallel_rank()) != 0:
        return
    state = {"args": Namespace(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                               virtual_pipeline_model_parallel_size=a.vpp, expert_model_parallel_size=a.ep,
                               expert_tensor_parallel_size=getattr(a, "etp", None),  # None: as TP
                               num_layers=a.layers, padded_vocab_size=padded_vocab(a.vocab, a.tp),
                               untie_embeddings_and_output_weights=not a.tied),
             "checkpoint_version": 3.0, "iteration": 1}
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict_for_save_checkpoint()
    else:
        for i, chunk in enumerate(chunks):
            state[f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    path = root / "iter_0000001" / legacy_dir(tp, pp, ep, a) / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def save_dist(a: Namespace, chunks: list, root: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    # the metadata Megatron-LM passes: GPTModel reads it itself on an MTP stage without the embedding's
    def own(chunk):
        return chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))

    if len(chunks) == 1:
        state = {"model": own(chunks[0])}
    else:
        state = {f"model{i}": own(chunk) for i, chunk in enumerate(chunks)}
    path = root / "iter_0000001"
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(path))


def write_model(a: Namespace, model, out: Path, oracle: Callable[[], dict | None], hf: Callable[[], object]) -> None:
    """This rank's model chunk saved as legacy/ and dist/, then its oracle (every rank computes it: a forward is
    collective; None on the stages without the logits) into logits.pt by the first rank holding it, and the HF
    config folder by rank 0."""
    from megatron.core import parallel_state as ps

    save_legacy(a, [model], out / "legacy")
    save_dist(a, [model], out / "dist")
    result = oracle()
    if result is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(result, out / "logits.pt")
    if dist.get_rank() == 0:
        write_save_dirs(out, hf())
    dist.barrier()


def forward_logits(a: Namespace, chunks: list, tokens: torch.Tensor, run: Callable | None = None):
    """Megatron's own forward over the whole pipeline: stage by stage, hidden states sent over gloo. Each chunk is
    called as `run(chunk)` where given (a VLM's own forward, which takes the image and makes its positions), else
    on `tokens` with their positions and a causal mask."""
    from megatron.core import parallel_state as ps

    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq)[None]
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), a.pp
    hidden_shape = (seq, 1, chunks[0].config.hidden_size)
    out = None
    with torch.no_grad():
        for vp, chunk in enumerate(chunks):
            for stage in range(pp):
                if stage != pp_rank:
                    continue
                first = vp == 0 and stage == 0
                if not first:
                    h = torch.empty(hidden_shape)
                    src = ps.get_pipeline_model_parallel_prev_rank()
                    dist.recv(h, src)
                    chunk.set_input_tensor(h)
                out = run(chunk) if run else chunk(tokens, positions, mask)
                last = vp == len(chunks) - 1 and stage == pp - 1
                if not last:
                    dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            # Stages run in order within a chunk pass; the ring send/recv above serialises them.
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        return out[..., :a.vocab]
    return None


def save_optimizer_only(root: Path) -> None:
    """A torch_dist checkpoint without model tensors, as verl leaves `dist_ckpt/` when it writes the weights
    as HF safetensors into `huggingface/`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    step = ShardedTensor.from_rank_offsets("optimizer.state.step", torch.tensor([1.0]), replica_id=dist.get_rank())
    (root / "iter_0000001").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"optimizer": {"step": step}}, str(root / "iter_0000001"))


def write_case(a: Namespace, out: Path) -> None:
    """One model in one parallel layout: both formats, the HF folder and the oracle logits."""
    from megatron.core import parallel_state as ps

    if a.optim_only:
        ps.initialize_model_parallel()
        save_optimizer_only(out / "dist")
        ps.destroy_model_parallel()
        return
    ps.initialize_model_parallel(a.tp, a.pp, virtual_pipeline_model_parallel_size=a.vpp,
                                 expert_model_parallel_size=a.ep)
    config = transformer_config(a)
    chunks = build_chunks(a, config)
    save_legacy(a, chunks, out / "legacy")
    save_dist(a, chunks, out / "dist")
    if a.lora:
        megatron_lora_adapters.attach(chunks, config, a.lora, a.alpha)
        megatron_lora_adapters.save_adapter_shards(chunks, out / "lora_dist" / "iter_0000001")
        save_dist(a, chunks, out / "lora_model_dist")
    tokens = torch.tensor([[3, 17, 42, 5, 99, 64, 8]])
    logits = forward_logits(a, chunks, tokens)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, out / "logits.pt")
    if dist.get_rank() == 0:
        write_save_dirs(out, hf_config(a, config))
    dist.barrier()
    ps.destroy_model_parallel()


def write_save_dirs(out: Path, hf, formats: tuple[str, ...] = ("legacy", "dist")) -> None:
    """Rank 0: the tracker file that makes each of `formats` (legacy/, dist/) a Megatron-LM save dir, and the HF
    config folder."""
    for fmt in formats:
        (out / fmt / "latest_checkpointed_iteration.txt").write_text("1")
    hf.architectures = [type(hf).__name__.replace("Config", "ForCausalLM")]
    hf.save_pretrained(out / "hf")
    build_tokenizer().save_pretrained(out / "hf")


def write_cases(out: Path, cases, write) -> None:
    """`write(args, folder)` for every case, in one gloo group: imports and startup are paid once."""
    dist.init_process_group("gloo")
    for name, a in cases:
        write(a, out / name)
    leave_group()


def main() -> None:
    out, cases = parse()
    cpu_patches()
    write_cases(out, cases, write_case)


if __name__ == "__main__":
    main()
