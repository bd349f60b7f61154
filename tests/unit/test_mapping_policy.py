"""The mapping layer alone, on in-memory catalogs: which mapper claims a checkpoint, and the tie and dtype policy.

Oracles: transformers' own save_pretrained (which tensors a model with or without tied embeddings writes), and
torch's Module.to(dtype) (which tensors a dtype change casts). No tensor data is read: the catalogs are built
from a model's state dict and the mapping never touches bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from merger.catalog import Catalog, PieceCopy, ShardPiece, SourceTensor
from merger.errors import MergerError
from merger.mapping.registry import build_mapping, mapper_for
from merger.options import MergeOptions

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)


def _catalog(state: dict[str, torch.Tensor], hf_dir: Path | None, naming: str = "hf") -> Catalog:
    tensors = {name: SourceTensor(name, tuple(t.shape), t.dtype,
                                  (ShardPiece((0,) * t.dim(), tuple(t.shape), (PieceCopy("f", name),)),))
               for name, t in state.items()}
    return Catalog("in-memory", Path("/nonexistent/checkpoint"), tensors, ["f"], reader_factory=None, hf_dir=hf_dir,
                   naming=naming)


def _options(**kw) -> MergeOptions:
    return MergeOptions(local_dir=Path("/nonexistent/checkpoint"), **kw)


def _outputs(catalog: Catalog, options: MergeOptions) -> dict[str, torch.dtype]:
    return {o.name: o.dtype for s in build_mapping(catalog, options).steps for o in s.outputs}


def _saved_names(model, folder: Path) -> set[str]:
    model.save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch, config", [
    ("LlamaForCausalLM", transformers.LlamaConfig(**TINY, tie_word_embeddings=True)),
    ("LlamaForCausalLM", transformers.LlamaConfig(**TINY, tie_word_embeddings=False)),
    ("GPT2LMHeadModel", transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)),  # ties by default
], ids=["llama-tied", "llama-untied", "gpt2"])
def test_tie_policy_writes_what_save_pretrained_writes(arch, config, tmp_path):
    model = getattr(transformers, arch)(config)
    saved = _saved_names(model, tmp_path / "saved")
    catalog = _catalog(dict(model.state_dict()), tmp_path / "saved")  # lm_head.weight is in the state dict either way
    assert set(_outputs(catalog, _options(dtype="keep"))) == saved


def test_tie_word_embedding_flag_ties_an_untied_config(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    model.config.save_pretrained(tmp_path)
    catalog = _catalog(dict(model.state_dict()), tmp_path)
    assert "lm_head.weight" in _outputs(catalog, _options())
    assert "lm_head.weight" not in _outputs(catalog, _options(tie_word_embedding=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_policy_casts_what_module_to_casts(dtype, tmp_path):
    """Floating tensors take --dtype, integer buffers keep theirs: as `Module.to(dtype)` does."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    model.register_buffer("step_count", torch.zeros(3, dtype=torch.int64))
    model.config.save_pretrained(tmp_path)
    want = {n: t.dtype for n, t in model.to(getattr(torch, dtype)).state_dict().items()}
    catalog = _catalog(dict(transformers.LlamaForCausalLM(model.config).state_dict(),
                            step_count=torch.zeros(3, dtype=torch.int64)), tmp_path)
    assert _outputs(catalog, _options(dtype=dtype)) == want


def test_each_naming_is_claimed_by_its_mapper(tmp_path):
    """The registry decides in one place: Megatron names by the catalog's naming, torchtitan by its names or
    --model, a PEFT-wrapped model by its adapter names, LoRA adapter folders by `merger lora`'s --adapter."""
    import peft

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    cases = {
        "hf": (_catalog(dict(model.state_dict()), tmp_path), _options()),
        "PEFT-wrapped model": (_catalog(dict(wrapped.state_dict()), tmp_path), _options()),
        "megatron": (_catalog({"decoder.final_layernorm.weight": torch.ones(4)}, tmp_path, "megatron"), _options()),
        "torchtitan": (_catalog({"tok_embeddings.weight": torch.ones(4, 2)}, tmp_path), _options()),
        "adapter folders": (_catalog(dict(model.state_dict()), tmp_path), _options(adapters=(tmp_path,))),
    }
    assert {want: mapper_for(c, o).name for want, (c, o) in cases.items()} == {want: want for want in cases}
    forced = _catalog({"tok_embeddings.weight": torch.ones(4, 2)}, tmp_path)
    assert mapper_for(forced, _options(model="hf")).name == "hf"


@pytest.mark.parametrize("flag", [dict(lora_r=8), dict(lora_alpha=16.0), dict(lora="separate"),
                                  dict(adapter_config=Path("a.json")), dict(base_model=Path("base"))])
def test_lora_flags_on_a_model_without_adapter_are_refused(flag, tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.config.save_pretrained(tmp_path)
    with pytest.raises(MergerError, match="applies to"):
        build_mapping(_catalog(dict(model.state_dict()), tmp_path), _options(**flag))


def test_value_model_config_names_the_token_classification_class(tmp_path):
    """config updates are applied once, after any mapper: a Megatron critic's config says
    XForTokenClassification with one label, as transformers' AutoModelForTokenClassification builds it."""
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(tmp_path)
    state = {"embedding.word_embeddings.weight": torch.ones(64, 16), "output_layer.weight": torch.ones(1, 16),
             "decoder.final_layernorm.weight": torch.ones(16)}
    mapping = build_mapping(_catalog(state, tmp_path, "megatron"), _options(is_value_model=True))
    written = json.loads((tmp_path / "config.json").read_text()) | mapping.config_updates
    model = transformers.AutoModelForTokenClassification.from_config(transformers.Qwen2Config(**written))
    assert type(model).__name__ == written["architectures"][0] and model.score.out_features == 1
    assert {o.name for s in mapping.steps for o in s.outputs} >= {"score.weight", "score.bias", "model.norm.weight"}


def test_torchtitan_gpt_oss_is_written_as_transformers_saves_it(tmp_path):
    """gpt_oss, built by torchtitan itself on the meta device: the names and shapes the mapping writes are those
    transformers' save_pretrained writes for the same GptOss config (fused experts kept fused, [E, in, out])."""
    try:
        from torchtitan.models import gpt_oss
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    except ModuleNotFoundError as e:
        pytest.skip(f"torchtitan (a test extra) cannot be imported here: {e}")
    config = gpt_oss.GptOssModel.Config(
        vocab_size=64, dim=32, tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=32),
        norm=RMSNorm.Config(normalized_shape=32), lm_head=Linear.Config(in_features=32, out_features=64),
        layers=gpt_oss._build_gptoss_layers(fuse_qkv=True, dim=32, n_layers=2, hidden_dim=24, num_experts=4, top_k=2,
                                            load_balance_coeff=1e-3, attn_backend="flex", moe_comm_backend="standard",
                                            rope=CosSinRoPE.Config(dim=64, max_seq_len=128, theta=150000.0)))
    with torch.device("meta"):
        state = config.build().state_dict()
    hf = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=4,
                                   num_experts_per_tok=2, tie_word_embeddings=False)
    saved = _saved_names(transformers.GptOssForCausalLM(hf), tmp_path)
    shapes = {o.name: o.shape for s in build_mapping(_catalog(dict(state), tmp_path), _options()).steps
              for o in s.outputs}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert shapes == {n: tuple(f.get_slice(n).get_shape()) for n in saved}
