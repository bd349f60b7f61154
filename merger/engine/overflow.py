"""Casts that lose values: float16 holds nothing beyond ±65504, so a cast from a wider float dtype turns larger
values into inf. The stream checks every such cast and the merge fails naming the tensors, unless
`--allow_overflow` accepts it. bfloat16 has float32's range, so the default cast needs no check."""
from __future__ import annotations

import torch


def may_have_overflowed(cast: torch.Tensor) -> bool:
    """A float16 result with an inf: whether a cast made it, only the source can tell (`overflowed`)."""
    return cast.dtype == torch.float16 and bool(torch.isinf(cast).any())


def overflowed(source: torch.Tensor, cast: torch.Tensor) -> bool:
    """True when `cast`, a float16 copy of `source`, holds an inf that `source` does not."""
    if cast.dtype != torch.float16 or source.dtype == torch.float16 or not source.is_floating_point():
        return False
    inf = torch.isinf(cast)
    return bool(inf.any()) and int(inf.sum()) != int(torch.isinf(source).sum())


def overflow_message(names: list[str], where: str) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"float16 cannot hold some values of {len(names)} tensors ({shown}): beyond ±65504 they would become "
            f"inf; use --dtype bfloat16, or pass --allow_overflow to write inf, {where}")
