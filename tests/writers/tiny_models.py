"""Tiny, seeded transformers models and their HF folders (config + a real tokenizer), built offline."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

WORDS = ("the a merger shard rank tensor model layer weight bias gather write read plan file byte "
         "checkpoint torch fast small large one two three four five six seven eight nine ten").split()


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
HEADS = {"causal-lm": "AutoModelForCausalLM", "token-cls": "AutoModelForTokenClassification",
         "seq-cls": "AutoModelForSequenceClassification"}


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
    if arch == "gpt_oss":  # MoE experts [E, in, out]; pass --hidden in 32s for MXFP4 (blocks of 32 along `in`)
        return transformers.GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=hidden // 4, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=16, max_position_embeddings=128, tie_word_embeddings=tied,
                                         rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    if arch == "qwen2_vl":
        # token ids of the vision markers are those build_tokenizer(vision=True) gives them
        ids = {tok: len(WORDS) + 2 + i for i, tok in enumerate(VISION_TOKENS)}
        text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, tie_word_embeddings=tied,
                    bos_token_id=None, eos_token_id=1, pad_token_id=1)
        vision = dict(depth=2, embed_dim=hidden, hidden_size=hidden, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                                          vision_start_token_id=ids["<|vision_start|>"],
                                          vision_end_token_id=ids["<|vision_end|>"],
                                          image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    raise ValueError(f"unknown tiny arch {arch}")


def build_model(arch: str, tied: bool = False, vocab: int | None = None, hidden: int | None = None,
                layers: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
                head: str = "causal-lm", num_labels: int = 1):
    """A seeded tiny model; `head` picks the transformers class (a critic is token-cls with one label)."""
    torch.manual_seed(seed)
    if arch == "remote":
        from tests.writers.remote_code.modeling_tiny_remote import TinyRemoteConfig, TinyRemoteForCausalLM

        config = TinyRemoteConfig(**tiny_config("llama", tied, vocab, hidden, layers).to_diff_dict())
        model = TinyRemoteForCausalLM(config).to(dtype)
    elif arch == "qwen2_vl":
        model = transformers.AutoModelForImageTextToText.from_config(tiny_config(arch, tied, vocab or 160, hidden,
                                                                                 layers), dtype=dtype)
    else:
        config = tiny_config(arch, tied, vocab, hidden, layers)
        if head != "causal-lm":
            config.num_labels, config.pad_token_id = num_labels, 1
        model = getattr(transformers, HEADS[head]).from_config(config, dtype=dtype)
    with torch.no_grad():  # biases and norms start at 0/1: randomise them so a mix-up cannot go unnoticed
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def build_tokenizer(vision: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<eos>"] + WORDS + (VISION_TOKENS if vision else [])
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"additional_special_tokens": VISION_TOKENS} if vision else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<eos>", **extra)


def build_image_processor():
    """Qwen2-VL's image processor, small images. (Its full processor also wants a video processor, which needs
    torchvision; the image processor and tokenizer are the processor files a VLM checkpoint carries.)"""
    return transformers.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


def save_hf_folder(model, folder: Path, remote_code: Path | None = None) -> None:
    """What verl writes into `huggingface/`: config, generation config and tokenizer or processor, no weights;
    for a remote-code model also its .py files, which config.json's auto_map names."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = model.config.architectures or [type(model).__name__]  # as a Hub config has
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:  # classification heads have none
        model.generation_config.save_pretrained(folder)
    vision = model.config.model_type == "qwen2_vl"
    build_tokenizer(vision).save_pretrained(folder)
    if vision:
        build_image_processor().save_pretrained(folder)
    if remote_code is not None:
        for source in remote_code.glob("*.py"):
            if source.name != "__init__.py":
                (folder / source.name).write_text(source.read_text())
