"""Recognizing torchao's NF4 weights (`litgpt.quantize`'s ao.nf4) without importing torchao: the check that the
model's kernels and LoRA need, kept apart from the quantization code so that neither imports `litgpt.quantize`."""

from __future__ import annotations

import sys
from typing import Optional

import torch


def is_nf4(tensor: Optional[torch.Tensor]) -> bool:
    """Whether `tensor` (or this rank's piece of a sharded one) is a torchao NF4Tensor (torchao is not imported)."""
    torchao = sys.modules.get("torchao.quantization")
    local = getattr(tensor, "_local_tensor", tensor)
    return torchao is not None and isinstance(local, torchao.NF4Tensor)
