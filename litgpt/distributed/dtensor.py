"""Pieces of sharded tensors (DTensor): read a rank's piece out of a whole tensor, gather a whole one, and draw random
initial weights so that a sharded model gets the same weights as one process from the same seed; a tensor stored with
its rows permuted (tensor parallelism's fused qkv) is read and gathered in its own order."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
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

    def __init__(self, row_orders: Optional[dict[int, torch.Tensor]] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        # id(parameter) -> the rows it stores permuted (tensor parallelism's fused qkv, `copy_into_shard`)
        self.row_orders = row_orders or {}
        # With a device, a draw for a tensor left on the meta device (another rank's expert) is made there and
        # dropped, so the random stream goes on as one process's.
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func not in self.RANDOM_INIT or not isinstance(target, torch.Tensor):
            return func(*args, **kwargs)
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.is_meta and self.device is not None:  # another rank's expert (split by tensor parallelism or not)
            self._draw_whole(func, args, kwargs, target, self.device)
        elif isinstance(target, DTensor):
            full = self._draw_whole(func, args, kwargs, target, local.device)
            copy_into_shard(target, full, self.row_orders.get(id(target)))
        else:
            return func(*args, **kwargs)
        return target

    @staticmethod
    def _draw_whole(func, args: tuple, kwargs: dict, target: torch.Tensor, device: torch.device) -> torch.Tensor:
        """What `func` draws for the whole of `target`, drawn on `device`."""
        full = torch.empty(target.shape, dtype=target.dtype, device=device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        return full


def copy_into_shard(target: torch.Tensor, full: torch.Tensor, row_order: Optional[torch.Tensor] = None) -> None:
    """Copy the piece of `full` (e.g. a memory-mapped checkpoint tensor) that this rank holds of `target`; with
    `row_order`, `target` stores row `row_order[i]` of `full` at row i.

    Only that piece is read, so loading a full checkpoint into a sharded model never holds the whole model.
    """
    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(full if row_order is None else full[row_order])
            return
        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        pieces = [slice(start, start + size) for start, size in zip(offset, shape)]
        if row_order is not None:  # the stored rows of this piece, read from where the full tensor keeps them
            pieces[0] = row_order[pieces[0]]
            piece = full[pieces[0]][(slice(None), *pieces[1:])]
        else:
            piece = full[tuple(pieces)]
        target.to_local().copy_(piece)


def gather_full(tensor: torch.Tensor, row_order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The whole tensor of a shard (every rank must call this; collective for a DTensor), its rows put back in
    their own order when it stores them permuted (`row_order`, see `copy_into_shard`)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    if row_order is None:
        return full
    restored = torch.empty_like(full)
    restored[row_order] = full
    return restored


def summed_gradient(x: torch.Tensor, mesh) -> torch.Tensor:
    """`x` (the same on every rank of the 1-D `mesh`) as it is, its gradient summed over the ranks: where each rank's
    consumers of `x` give only their share of its gradient (their heads, their width of an expert, their vocabulary
    rows). Megatron's "copy to the tensor-parallel region"."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def clip_to_norm(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` (whole tensors or DTensors) in place so that gradients whose norm is `total_norm` (computed by
    the caller over every rank that holds some of them) have a norm of at most `max_norm`."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
