"""Recognizing torchao's NF4 weights (`litgpt.quantize`'s ao.nf4) without importing torchao, and computing with one
stored with rows appended: what the model's kernels and LoRA need, kept apart from the quantization code so that
neither imports `litgpt.quantize`."""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F


def is_nf4(tensor: Optional[torch.Tensor]) -> bool:
    """Whether `tensor` (or this rank's piece of a sharded one) is a torchao NF4Tensor (torchao is not imported)."""
    torchao = sys.modules.get("torchao.quantization")
    local = getattr(tensor, "_local_tensor", tensor)
    return torchao is not None and isinstance(local, torchao.NF4Tensor)


def linear_of_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """`F.linear` with the first `rows` rows of `weight`: an NF4 weight stored with rows appended so that FSDP can
    split it (`litgpt.quantize.store_nf4`) computes them all, and the appended ones are dropped."""
    if weight.shape[0] == rows:
        return F.linear(x, weight, bias)
    out = F.linear(x, weight)[..., :rows]
    return out if bias is None else out + bias
