"""verl actor folders of a Megatron LoRA run with Megatron-Bridge (layout schema v2), and PEFT's oracle.

    python -m tests.writers.verl_megatron_lora --out DIR

Writes under DIR: `base/` (the model the run started from), `adapter/` (the adapter, by PEFT's save_pretrained),
`reference/` (PEFT's merge_and_unload), `logits.pt` (the unmerged PeftModel's logits on TOKENS), and two actor
folders as verl's MegatronCheckpointManager lays them out, `ckpt_contents.json` included:
- `bridge/actor/`: model/huggingface/ holds config, tokenizer and the exported adapter/ only, as Megatron-Bridge
  saves a PEFT model (bridge.save_hf_adapter);
- `mbridge/actor/`: the base weights beside them, as mbridge writes the HF weights.
Megatron-Bridge itself needs Transformer Engine, which a CPU-only torch cannot import; its HF export is a PEFT
adapter folder, which PEFT writes here.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import peft
import torch

from tests.writers.tiny_models import build_model, build_tokenizer

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 0, 6, 1]])
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HF = {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge"}
DIST = {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"}
LORA_HF = {**HF, "peft_adapter_path": "model/huggingface/adapter"}
LORA_DIST = {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint",
             "note": "PEFT adapter shards sit next to base-model HF weights, under model/dist_ckpt/."}


def write_manifest(actor: Path, contents: dict, peft_on: bool = False, dist: bool = False) -> None:
    """ckpt_contents.json as verl writes it (rank 0, last), with `contents` as given."""
    data = {"schema_version": 2, "framework": "megatron", "role": "actor", "arch": "Qwen2ForCausalLM",
            "global_step": 1, "world_size": 2, "saved_any_dist_ckpt": True,
            "backend": {"has_bridge": True, "use_dist_checkpointing": dist, "peft": peft_on},
            "save_contents": ["model", "optimizer", "extra"], "contents": contents, "directories": {}}
    (actor / "ckpt_contents.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def write_run(root: Path) -> None:
    """base/, adapter/, reference/ and logits.pt."""
    model = build_model("qwen2")
    model.save_pretrained(root / "base")
    build_tokenizer().save_pretrained(root / "base")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    wrapped.save_pretrained(root / "adapter")
    with torch.no_grad():
        torch.save(wrapped(TOKENS).logits, root / "logits.pt")
    wrapped.merge_and_unload().save_pretrained(root / "reference")


def write_actor(run: Path, where: Path, base_weights: bool, adapter_shards: Path | None = None) -> Path:
    """An actor folder of the LoRA run in `run`: model/huggingface/ with config, tokenizer and the exported adapter
    (and the base weights when mbridge wrote them); `adapter_shards` (a torch_dist folder) as model/dist_ckpt/."""
    actor = where / "actor"
    hf = actor / "model" / "huggingface"
    shutil.copytree(run / "base", hf, ignore=None if base_weights else shutil.ignore_patterns("*.safetensors*"))
    shutil.copytree(run / "adapter", hf / "adapter")
    if adapter_shards is not None:
        shutil.copytree(adapter_shards, actor / "model" / "dist_ckpt")
    (actor / "optimizer" / "dist_ckpt").mkdir(parents=True)
    contents = {"model": LORA_HF, "hf_config": HF, **({"peft_adapters": LORA_DIST} if adapter_shards else {})}
    write_manifest(actor, contents, peft_on=True)
    return actor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    out = p.parse_args().out
    write_run(out)
    write_actor(out, out / "bridge", base_weights=False)
    write_actor(out, out / "mbridge", base_weights=True)


if __name__ == "__main__":
    main()
