"""LoRA as mappers: adapter folders folded into a base (`merger lora`), adapters saved alone, PEFT-wrapped models."""
