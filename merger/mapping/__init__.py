"""The mapping: source tensor names to output steps. registry.py picks the mapper; policy.py applies ties and
dtypes once; model families are typed records (families.py) whose rows' kinds (kinds.py) carry the transforms;
LoRA modes are mappers too (lora/)."""
