"""The baseline: what verl's model merger and most scripts do. Load every rank file whole, concatenate each
tensor's shards along dim 0, cast to bf16, and save the full state dict in one go."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401  DTensor for the weights_only unpickler
from safetensors.torch import save_file


def main(src: Path, dst: Path) -> None:
    files = sorted(src.glob("model_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    states = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    merged = {}
    for name in states[0]:
        shards = [s[name] for s in states]
        local = [getattr(t, "_local_tensor", t) for t in shards]
        merged[name] = torch.cat(local, dim=0).to(torch.bfloat16).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(dst / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
