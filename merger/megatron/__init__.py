"""Megatron checkpoints: where they live on disk (layout), how catalog keys name sub-boxes (keys), the
name tables from Megatron to HF per model family (families) and the pure tensor transforms (transforms).

Both on-disk formats (merger/sources/megatron_legacy.py, megatron_dist.py) catalog the same canonical
tensors: Megatron names with global layer and expert numbers, TP-independent global shapes, fc1 exactly
cat(gate, up). So one mapping serves both.
"""
