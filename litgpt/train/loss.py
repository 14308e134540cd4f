"""The losses a recipe trains with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from litgpt.data.base import IGNORE_INDEX


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions that have a label (0, not NaN, when none has: a fully masked batch)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


LOSSES = {"cross_entropy": cross_entropy}
