"""The public ways to turn a DCP folder into safetensors: the baselines benchmarks/run.py times for DCP.

    python benchmarks/dcp_baselines.py dcp_to_torch_save DCP_DIR OUT_DIR
    python benchmarks/dcp_baselines.py accelerate DCP_DIR OUT_DIR

- dcp_to_torch_save: torch's `dcp_to_torch_save` into one .pt file, then `torch.load` + safetensors
  `save_file` (what users do by hand; the nested `{"model": ...}` of accelerate is unwrapped).
- accelerate: `accelerate.utils.merge_fsdp_weights(dir, out, safe_serialization=True)` (it expects a folder
  holding the model alone, as accelerate writes it: `pytorch_model_fsdp_0/`, optimizer elsewhere).
Both load the whole model into one process and keep its dtype. This script only does the work; run.py runs
it in a fresh process and measures wall time and peak RSS from outside, like every other row.
"""
from __future__ import annotations

import sys
from pathlib import Path


def dcp_to_torch_save(dcp_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as convert

    out.mkdir(parents=True, exist_ok=True)
    pt = out / "full.pt"
    convert(dcp_dir, pt)
    state = torch.load(pt, map_location="cpu", weights_only=True)
    if isinstance(state.get("model"), dict):
        state = state["model"]  # accelerate's {"model": state_dict}
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    pt.unlink()


def accelerate(dcp_dir: Path, out: Path) -> None:
    from accelerate.utils import merge_fsdp_weights

    out.parent.mkdir(parents=True, exist_ok=True)  # accelerate creates `out` itself, but not its parents
    merge_fsdp_weights(str(dcp_dir), str(out), safe_serialization=True)


BASELINES = {"dcp_to_torch_save": dcp_to_torch_save, "accelerate": accelerate}

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in BASELINES:
        raise SystemExit(__doc__.split("\n\n")[1])
    BASELINES[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
