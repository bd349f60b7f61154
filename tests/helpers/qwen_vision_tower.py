"""The check the Qwen3-VL and Qwen3.5 VLM tests make of a merged vision tower against tests/writers/
megatron_qwen3_vl.py's oracle: HF's modules (transformers' own forward) given the inputs Megatron's were given."""
from __future__ import annotations

import torch


def assert_close(ours: torch.Tensor, megatron: torch.Tensor) -> None:
    assert ours.shape == megatron.shape
    assert (ours - megatron).abs().max().item() < 1e-4


def assert_tower_is_megatrons(visual, expected: dict) -> None:
    """The blocks (fused qkv split per head into HF's [q; k; v], TP-split linears, LayerNorms) over Megatron's patch
    sequence with its rotary table, the final and any deepstack patch mergers and the patch embedding, each on its
    own input, compute what Megatron's modules did (fp32, max abs diff < 1e-4)."""
    hidden, freqs = expected["hidden"], expected["freqs"]
    cu_seqlens = torch.tensor([0, hidden.shape[0]], dtype=torch.int32)
    with torch.no_grad():
        for block in visual.blocks:
            hidden = block(hidden, cu_seqlens=cu_seqlens, position_embeddings=(freqs.cos(), freqs.sin()))
        assert_close(hidden, expected["blocks"])
        mergers = (visual.merger, *getattr(visual, "deepstack_merger_list", ()))
        for merger, out in zip(mergers, expected["mergers"], strict=True):
            assert_close(merger(expected["hidden"]), out)
        assert_close(visual.patch_embed(expected["pixels"]), expected["embedded"])
