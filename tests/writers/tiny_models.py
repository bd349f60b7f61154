"""Tiny, seeded transformers models and their HF folders (config + a real tokenizer), built offline."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

WORDS = ("the a merger shard rank tensor model layer weight bias gather write read plan file byte "
         "checkpoint torch fast small large one two three four five six seven eight nine ten").split()


def tiny_config(arch: str, tied: bool = False, vocab: int | None = None, hidden: int | None = None,
                layers: int | None = None):
    vocab = vocab or 101  # prime: not divisible by any world size, so FSDP shards are uneven
    hidden = hidden or 32
    layers = layers or 2
    if arch == "llama":
        return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied, max_position_embeddings=128)
    if arch == "qwen2":
        return transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied, max_position_embeddings=128)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=128,
                                       tie_word_embeddings=True)
    raise ValueError(f"unknown tiny arch {arch}")


def build_model(arch: str, tied: bool = False, vocab: int | None = None, hidden: int | None = None,
                layers: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(arch, tied, vocab, hidden, layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # biases and norms start at 0/1: randomise them so a mix-up cannot go unnoticed
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<eos>")


def save_hf_folder(model, folder: Path) -> None:
    """What verl writes into `huggingface/`: config, generation config and tokenizer, no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
