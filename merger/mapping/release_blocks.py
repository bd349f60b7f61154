"""Byte-identical where nothing changed: `--quantize_like RELEASE` keeps the release's own bytes for every
quantization block whose values training left as they were.

Dequantizing and quantizing again is not the identity in the formats merger writes: transformers' ue8m0 rule can
pick a power of two one lower than the release's (and then doubles each code), and a quantizer that never writes
-0 loses the release's -0 codes. So the release's codes are read back where the output is written, one tensor (or
slab of experts) at a time, and each block (FP8's b0 x b1, MX's and INT4's 32 elements) is compared with the
incoming one: where the release's dequantized block, cast to the dtype the output is quantized from (or read at
bfloat16 and widened to it), equals the incoming block bit for bit, the block keeps the release's codes and its
scale; every other block is what the producing tool's
quantizer gives for it. The formats merger writes have no scale shared across blocks, so a block's bytes depend on
that block alone, and a tensor changed in part keeps the bytes of its unchanged blocks.

The release's tensors are known from its safetensors headers (file and offset); a Hub id's release has only its
headers here (mapping/hub_folders.py fetches none of its weights), so nothing is kept and every block is quantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CorruptSourceError
from ..io import read_range
from ..safetensors_io import nbytes_of

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
READ_DTYPE = torch.bfloat16  # what merger reads a release at unless --dtype says otherwise


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the release: its dtype and shape, and where its bytes are (None: only its header is known)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str | None = None
    offset: int = 0  # where its bytes begin in `file`

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or the rows [lo, hi) of its first dim (the slab of experts a step writes)."""
        if not self.shape:  # a scalar (ModelOpt's weight_scale_2, input_scale): one row of its one element
            return self._rows(0, 1, nbytes_of((), self.dtype)).reshape(())
        lo, hi = rows or (0, self.shape[0])
        return self._rows(lo, hi, nbytes_of(self.shape[1:], self.dtype)).reshape(hi - lo, *self.shape[1:])

    def _rows(self, lo: int, hi: int, row: int) -> torch.Tensor:
        """The bytes of rows [lo, hi) of `row` bytes each, as a flat tensor of the dtype."""
        data = read_range(self.file, self.offset + lo * row, (hi - lo) * row)
        if len(data) != (hi - lo) * row:
            raise CorruptSourceError(f"the release's file ends inside one of its tensors (--quantize_like reads it "
                                     f"back to keep the bytes of unchanged blocks), {self.file}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bit for bit (-0.0 is not 0.0, a NaN equals the same NaN)."""
    return a.view(_BITS[a.element_size()]) == b.view(_BITS[b.element_size()])


def as_read(values: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether `tensor` holds the release's `values` (dequantized in float32) as reading the release
    gives them: cast to `tensor`'s dtype, or read at bfloat16 (merger's default --dtype) and widened to it since
    (a release read at bfloat16 and written from --dtype float32: products such as INT4's code x bfloat16 scale are
    exact in float32 but were rounded when read)."""
    same = _same_bits(values.to(tensor.dtype), tensor)
    if tensor.element_size() > READ_DTYPE.itemsize:
        same |= _same_bits(values.to(READ_DTYPE).to(tensor.dtype), tensor)
    return same


def unchanged_blocks(same: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per block of [b0, b1] elements of the last two dims of `same` (a partial edge block: the elements it has),
    whether all of its elements are the same: a grid [..., ceil(rows / b0), ceil(cols / b1)]."""
    b0, b1 = block
    rows, cols = same.shape[-2:]
    grid = (-(-rows // b0), -(-cols // b1))
    whole = torch.ones((*same.shape[:-2], grid[0] * b0, grid[1] * b1), dtype=torch.bool)
    whole[..., :rows, :cols] = same
    return whole.unflatten(-1, (grid[1], b1)).unflatten(-3, (grid[0], b0)).all(-1).all(-2)


def per_element(grid: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """A block grid spread over the elements of a tensor of `shape` (the inverse of unchanged_blocks' reduction)."""
    return grid.repeat_interleave(block[0], dim=-2)[..., :shape[-2], :].repeat_interleave(block[1], dim=-1)[
        ..., :shape[-1]]


def keep(where: torch.Tensor, release: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The release's values where `where`, else the new ones, in the new ones' dtype (the one written: a release's
    float scales are exact in float32); chosen as bytes, as float8 has no where."""
    bits = _BITS[new.element_size()]
    return torch.where(where, release.to(new.dtype).view(bits), new.view(bits)).view(new.dtype)
