"""The small typed interface through which the checkpoint manager reads and writes a strategy's model.

A strategy that shards or compiles the model its own way (FSDP2 here; Thunder's FSDP in extensions/thunder) gives
the manager an object with these methods, and the manager does the rest (staging, manifest, publish, prune,
resume). Every implementation reads files only through `litgpt.io`'s safe readers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

KeySelector = Callable[[str], bool]


@runtime_checkable
class CheckpointIO(Protocol):
    """How a strategy's (possibly sharded) model and optimizer go to and from litgpt's checkpoint formats.

    `model` is the module the strategy set up; `select(key)` says which weights a checkpoint holds (every key, or the
    LoRA adapters'). Methods marked collective are entered by every rank.
    """

    sharding_strategy: str  # how the parameters are laid out ("none" on one device), for manifests and metrics
    state_dict_type: str  # "full": rank 0 writes one weights file; "sharded": every rank writes its shards
    options: dict  # the strategy's settings, for metrics.json

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters the optimizer updates."""

    def gather_weights(self, model: nn.Module, select: KeySelector) -> dict[str, torch.Tensor]:
        """The selected weights as whole CPU tensors on rank 0, {} elsewhere (collective)."""

    def gather_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state keyed by parameter names, whole, on rank 0 (collective)."""

    def copy_weights(self, model: nn.Module, state_dict: dict, source: str, select: KeySelector) -> None:
        """Copy the selected keys of a whole state dict (memory-mapped) into the model, each rank its part."""

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a whole, name-keyed optimizer state (`gather_optimizer_state`'s)."""

    def save_sharded(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     select: KeySelector) -> None:
        """Every rank writes its shards of the selected weights and of the optimizer state into folder/sharded."""

    def load_sharded(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     select: KeySelector) -> None:
        """Read folder/sharded (any world size) into the model and optimizer (collective)."""
