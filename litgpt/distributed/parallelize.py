"""The one place that takes a model built on the meta device to its devices, in a fixed order: dtype, activation
checkpointing, compilation, sharding, then materialization and initialization (torchtitan's order).

The model file knows nothing of this; recipes call `parallelize`.
"""

from __future__ import annotations

import functools
from typing import Callable, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from litgpt.args import ActivationCheckpointing
from litgpt.distributed.activation_checkpointing import selective_checkpoint_contexts
from litgpt.distributed.dtensor import FullTensorInit
from litgpt.distributed.fsdp import FSDPStrategy, shard_model
from litgpt.precision import PRECISION_DTYPES


def parallelize(
    fabric,
    model: nn.Module,
    precision: str,
    initialize: Callable[[nn.Module], None],
    activation_checkpointing: Union[bool, int, str, ActivationCheckpointing],
    compile_blocks: bool = False,
) -> nn.Module:
    """Take a model built on the meta device to `fabric.device`, in the fixed order: dtype, activation checkpointing,
    compilation (`compile_blocks`), sharding, then materialization and initialization (`initialize`), so no process
    ever holds the full model.

    `activation_checkpointing` is any setting `ActivationCheckpointing.parse` reads (false, true, N, every:N, ops).
    Initialization is rank-aware: a sharded model gets the same weights as a single-process model from the same seed.
    """
    if precision in ("bf16-true", "16-true"):
        model.to(PRECISION_DTYPES[precision])
    checkpointing = ActivationCheckpointing.parse(activation_checkpointing)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
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


def apply_activation_checkpointing(
    model: torch.nn.Module, checkpointing: Union[bool, int, str, ActivationCheckpointing] = "full"
) -> None:
    """Recompute transformer blocks' activations during the backward pass instead of storing them: every block
    (full), one block in N (every:N), or inside every block all but the outputs of matmuls and attention (ops)."""
    checkpointing = ActivationCheckpointing.parse(checkpointing)
    options = dict(use_reentrant=False)
    if checkpointing.mode == "ops":
        options["context_fn"] = selective_checkpoint_contexts
    for index, block in enumerate(model.transformer.h):
        if checkpointing.checkpoints(index):
            block.forward = functools.partial(checkpoint, block.forward, **options)
