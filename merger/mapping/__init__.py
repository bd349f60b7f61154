"""The mapping: source tensor names to output steps. registry.py picks the mapper; policy.py applies ties and
dtypes once; model families are tables (megatron_families.py); LoRA modes are mappers too (lora/)."""
