"""`--train.offload_activations`: the tensors autograd saves for the backward pass go to host memory during the
forward pass and come back to the device when the backward pass reads them (PyTorch's saved-tensor hooks).

`parallelize` runs the model's forward pass under `ActivationOffload` (`offload_activations`), around the
checkpointed and compiled blocks, so it composes with both:

- a block under non-reentrant activation checkpointing saves only its input, through autograd (checkpoint's own
  save of its inputs): that input is what goes to the host;
- a compiled block saves what its graph keeps through autograd too (one function's saved tensors), all of which go
  to the host. The hooks stay outside the compiled code: dynamo cannot trace into saved-tensor hooks, so a model
  whose forward pass runs inside a compiled loss would run eager (`litgpt.train.launch.set_compilation` compiles
  the blocks instead);
- op-level checkpointing (`ops`) run eagerly holds the outputs it keeps in its own cache, outside autograd's saved
  tensors: those stay on the device (the blocks' inputs move).

Parameters, and views of them (a linear layer saves its weight transposed), are never copied: they stay on the
device anyway (FSDP gathers them again for the backward pass). On CUDA the host copies are pinned and made without
waiting (on the compute stream, so the copy is ordered before the device memory is reused); on a CPU the copies
stay in the same memory, so the option saves nothing there but runs the same path (tests use it to prove the
results unchanged).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

# What `pack` returns for a tensor it moved: the device and the strides it goes back with, and its host copy.
Offloaded = tuple[torch.device, tuple[int, ...], torch.Tensor]


def is_parameter_data(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a parameter or a view of one (`weight.t()` in a linear layer's saved tensors)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def is_broadcast(tensor: torch.Tensor) -> bool:
    """Whether elements of `tensor` share memory (an expanded view): no copy can be laid out in its strides."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def moves(tensor: torch.Tensor) -> bool:
    """Whether `pack` copies `tensor` to the host: a plain dense tensor (not a parameter's data, not a subclass such
    as an NF4 weight, whose layout a plain copy would lose, not an expanded view of a smaller one)."""
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided and not is_parameter_data(tensor)
            and not is_broadcast(tensor))


def pack(tensor: torch.Tensor) -> Union[torch.Tensor, Offloaded]:
    """The host copy of a saved tensor (pinned when it comes from a CUDA device; a view's elements only), or the
    tensor itself when it stays (`moves`)."""
    if not moves(tensor):
        return tensor
    host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, tensor.stride(), host


def unpack(packed: Union[torch.Tensor, Offloaded]) -> torch.Tensor:
    """The saved tensor back on its device, when the backward pass reads it, in its own strides: a compiled
    backward pass checks them (a slice of the fused q/k/v projection is not laid out as a copy of it)."""
    if isinstance(packed, torch.Tensor):
        return packed
    device, stride, host = packed
    if host.stride() == stride:
        return host.to(device, non_blocking=host.is_pinned())
    restored = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)
    return restored.copy_(host, non_blocking=host.is_pinned())


class ActivationOffload(saved_tensors_hooks):
    """A context: every tensor autograd saves inside it is kept in host memory until the backward pass (`pack`)."""

    def __init__(self) -> None:
        super().__init__(pack, unpack)


def offload_activations(model: nn.Module) -> None:
    """Run `model`'s forward pass under `ActivationOffload` (its instance's forward, as checkpointing wraps the
    blocks'; the model's class stays plain single-device PyTorch)."""
    model.forward = offloaded(model.forward)


def offloaded(forward: Callable) -> Callable:
    """`forward` run under `ActivationOffload`; a pass without gradients saves nothing and copies nothing."""

    def forward_with_offload(*args, **kwargs):
        with ActivationOffload():
            return forward(*args, **kwargs)

    return forward_with_offload
