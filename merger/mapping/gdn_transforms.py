"""Pure transforms from megatron-core's Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) to HF's layouts, each with its
shape rule beside it.

The catalog presents GatedDeltaNet's input projection as its sections whole, one after another (the
sources/megatron_sections.py layout): rows [q (key heads x dk); k (same); v (value heads x dv); z (same);
b (value heads); a (value heads)]. Value head j belongs to key head j // (value heads / key heads) in both
libraries. HF's qwen3_5 keeps it flat, in_proj_qkv = [q; k; v], in_proj_z, in_proj_b, in_proj_a; HF's qwen3_next
groups it per key head: in_proj_qkvz = per key head [q_h; k_h; its v heads; their z], in_proj_ba = per key head
[its b; its a].

Megatron's gated attention (attention_output_gate) stacks, per query group, that group's query heads, then as
many gate heads, then one key and one value head; HF's q_proj interleaves [q_h; gate_h] per query head.

Megatron's zero-centred RMSNorm scales by 1 + weight where HF's gated norm scales by weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MergerError


@dataclass(frozen=True)
class DeltaNetDims:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, config: dict) -> "DeltaNetDims":
        keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        missing = [k for k in keys if not isinstance(config.get(k), int)]
        if missing:
            raise MergerError(f"config.json has no {', '.join(missing)} (the Gated DeltaNet's sizes come from the HF "
                              f"config of the model, --hf_model_config_path)")
        dims = cls(*(config[k] for k in keys))
        if dims.value_heads % dims.key_heads:
            raise MergerError(f"config.json's linear_num_value_heads {dims.value_heads} is no multiple of "
                              f"linear_num_key_heads {dims.key_heads}")
        return dims

    @property
    def sections(self) -> list[int]:
        """Rows of in_proj's sections: q, k, v, z, b, a."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return [qk, qk, v, v, self.value_heads, self.value_heads]


def _check_in_proj(shape: tuple[int, ...], dims: DeltaNetDims, name: str) -> tuple[int, ...]:
    if shape[0] != sum(dims.sections):
        raise MergerError(f"tensor {name} has {shape[0]} rows where config.json's Gated DeltaNet ({dims.key_heads} "
                          f"key heads of dim {dims.key_dim}, {dims.value_heads} value heads of dim {dims.value_dim}) "
                          f"needs {sum(dims.sections)} (pass the HF config of this model with "
                          f"--hf_model_config_path), config.json")
    return tuple(shape[1:])


def flat_in_proj_shapes(shape: tuple[int, ...], dims: DeltaNetDims, name: str) -> list[tuple[int, ...]]:
    rest = _check_in_proj(shape, dims, name)
    q, k, v, z, b, a = dims.sections
    return [(q + k + v, *rest), (z, *rest), (b, *rest), (a, *rest)]


def split_flat_in_proj(tensors: list[torch.Tensor], dims: DeltaNetDims) -> list[torch.Tensor]:
    """[q; k; v; z; b; a] -> in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (HF qwen3_5)."""
    q, k, v, z, b, a = tensors[0].split(dims.sections, dim=0)
    return [torch.cat([q, k, v]), z, b, a]


def grouped_in_proj_shapes(shape: tuple[int, ...], dims: DeltaNetDims, name: str) -> list[tuple[int, ...]]:
    rest = _check_in_proj(shape, dims, name)
    q, k, v, z, b, a = dims.sections
    return [(q + k + v + z, *rest), (b + a, *rest)]


def split_grouped_in_proj(tensors: list[torch.Tensor], dims: DeltaNetDims) -> list[torch.Tensor]:
    """[q; k; v; z; b; a] -> in_proj_qkvz and in_proj_ba grouped per key head (HF qwen3_next)."""
    w = tensors[0]
    rest = w.shape[1:]
    per_key = [s.reshape(dims.key_heads, -1, *rest) for s in w.split(dims.sections, dim=0)]
    q, k, v, z, b, a = per_key
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, *rest), torch.cat([b, a], dim=1).reshape(-1, *rest)]


def gated_qkv_shapes(shape: tuple[int, ...], heads: int, groups: int, head_dim: int, name: str
                     ) -> list[tuple[int, ...]]:
    if heads % groups or shape[0] != (2 * heads + 2 * groups) * head_dim:
        raise MergerError(f"tensor {name} has {shape[0]} rows; gated attention with {heads} heads in {groups} query "
                          f"groups of head dim {head_dim} needs {(2 * heads + 2 * groups) * head_dim} "
                          f"(check config.json)")
    rest = tuple(shape[1:])
    return [(2 * heads * head_dim, *rest), (groups * head_dim, *rest), (groups * head_dim, *rest)]


def split_gated_qkv(tensors: list[torch.Tensor], heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    """Per group [q heads; gate heads; k; v] -> q_proj as [q_h; gate_h] per head, k_proj, v_proj."""
    (w,) = tensors
    rest = w.shape[1:]
    per = heads // groups
    q, gate, k, v = w.reshape(groups, (2 * per + 2) * head_dim, *rest).split(
        [per * head_dim, per * head_dim, head_dim, head_dim], dim=1)
    q, gate = (t.reshape(groups, per, head_dim, *rest) for t in (q, gate))
    return [torch.stack([q, gate], dim=2).reshape(2 * heads * head_dim, *rest),
            k.reshape(groups * head_dim, *rest), v.reshape(groups * head_dim, *rest)]


def plus_one(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A zero-centred norm weight (scale 1 + w) as a plain one (scale w), in fp32: the writer casts it once."""
    return [tensors[0].float() + 1]
