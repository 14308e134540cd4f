"""Pieces of sharded tensors (DTensor): read a rank's piece out of a whole tensor, gather a whole one, and draw random
initial weights so that a sharded model gets the same weights as one process from the same seed."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class FullTensorInit(torch.overrides.TorchFunctionMode):
    """Random initializers on a sharded tensor (DTensor) draw the full tensor, as one process would, and keep this
    rank's piece: the same weights for any world size, from the same seed."""

    RANDOM_INIT = {
        torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
        # nn.init's functions are override points of their own (called with `tensor=`); inside one the mode is off.
        nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
        nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.orthogonal_,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func in self.RANDOM_INIT and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            if args:
                func(full, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": full})
            copy_into_shard(target, full)
            return target
        return func(*args, **kwargs)


def copy_into_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the piece of `full` (e.g. a memory-mapped checkpoint tensor) that this rank holds of `target`.

    Only that piece is read, so loading a full checkpoint into a sharded model never holds the whole model.
    """
    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(full)
            return
        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        piece = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
        target.to_local().copy_(piece)


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (every rank must call this; collective for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
