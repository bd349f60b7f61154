"""A tiny model that transformers knows only through remote code (config.json's auto_map points here).

It is Llama underneath with its own model_type, as custom checkpoints on the Hub usually are.
"""
from transformers import LlamaConfig, LlamaForCausalLM


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"

    def __init__(self, **kwargs):
        kwargs.setdefault("auto_map", {"AutoConfig": "modeling_tiny_remote.TinyRemoteConfig",
                                       "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
        super().__init__(**kwargs)


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
