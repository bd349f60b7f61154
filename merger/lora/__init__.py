"""LoRA: fold PEFT adapters into base weights, exactly as PEFT merges them, and write PEFT adapter folders."""
