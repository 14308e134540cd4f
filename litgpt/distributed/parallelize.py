"""The one place that takes a model built on the meta device to its devices, in a fixed order: dtype, activation
checkpointing, compilation, sharding, then materialization and initialization (torchtitan's order).

The model file knows nothing of this; recipes call `parallelize`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from litgpt.distributed.dtensor import FullTensorInit
from litgpt.distributed.fsdp import FSDPStrategy, shard_model
from litgpt.precision import PRECISION_DTYPES


def parallelize(
    fabric,
    model: nn.Module,
    precision: str,
    initialize: Callable[[nn.Module], None],
    activation_checkpointing: bool,
    compile_blocks: bool = False,
) -> nn.Module:
    """Take a model built on the meta device to `fabric.device`, in the fixed order: dtype, activation checkpointing,
    compilation (`compile_blocks`), sharding, then materialization and initialization (`initialize`), so no process
    ever holds the full model.

    Initialization is rank-aware: a sharded model gets the same weights as a single-process model from the same seed.
    """
    if precision in ("bf16-true", "16-true"):
        model.to(PRECISION_DTYPES[precision])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_blocks:
        compile_each_block(model)
    strategy = fabric.strategy
    if isinstance(strategy, FSDPStrategy):
        shard_model(model, strategy.device_mesh, strategy.fsdp, precision, fabric.device)
    model.to_empty(device=fabric.device)
    with torch.no_grad(), FullTensorInit():
        initialize(model)
    return model


def compile_each_block(model: torch.nn.Module) -> None:
    """`torch.compile` every transformer block in place (`--compiler torch`): after activation checkpointing and
    before sharding, torchtitan's order, so each graph is one block with its recomputation and FSDP's hooks stay
    around it; compiled in place, the blocks keep their parameter names."""
    for block in model.transformer.h:
        block.compile()


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every transformer block's activations during the backward pass instead of storing them."""
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
