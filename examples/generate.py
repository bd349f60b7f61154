"""Load a merged folder with transformers alone and generate a few tokens: proof the output is a real model."""
import sys

import torch
import transformers

folder = sys.argv[1]
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModelForCausalLM.from_pretrained(folder)
inputs = tokenizer("the merger reads a shard", return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
print(f"loaded {type(model).__name__} ({model.dtype}, {sum(p.numel() for p in model.parameters())} parameters) "
      f"from {folder}")
print("generated:", tokenizer.decode(out[0][inputs["input_ids"].shape[1]:]))
