"""x @ W.T for a frozen quantized weight W (QLoRA's base layers) whose backward pass dequantizes W a slice at a time.

torchao's and bitsandbytes' linear functions dequantize the whole weight for the backward pass's matmul (torchao's NF4
for the forward pass too): the weight in 16 bits and, for torchao, int64 codes and two more copies, 14 bytes a
weight, 11.4 GiB for one 53,248 x 16,384 MLP weight of Llama 3.1 405B. Here the input's gradient is computed a block
of W's columns at a time: grad_x[:, j] needs only column j of W, so every element of it is still one whole reduction
over the output features, as in a single matmul, and no sum is split. A quantized format plugs in as a `Slicer`: its
forward pass (`forward_by_rows` for a format without a fused kernel of its own) and how it dequantizes a block of its
rows or columns. What one slice holds is bounded by `SLICE_NUMEL` weights.
"""

from __future__ import annotations

from typing import Protocol

import torch

SLICE_NUMEL = 2**23  # weights dequantized at once: 16 MiB in 16 bits


class Dequantizer(Protocol):
    """Dequantizes slices of one weight in its dtype, for one pass (what it prepares, such as every block's scale,
    is freed with it)."""

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """W[start:stop]."""

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """W[:, start:stop], every stored row."""


class Slicer(Protocol):
    """A frozen quantized weight stored as `shape` (rows, in), of which a layer computes the first `out_features`
    rows. Column slices start at multiples of `column_step` (0: the format cannot slice columns, and the backward pass
    dequantizes the weight whole)."""

    shape: tuple[int, int]
    out_features: int
    column_step: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x (..., in), gradients off."""

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the forward pass multiplies x in, which the backward pass multiplies the gradient in."""

    def dequantizer(self) -> Dequantizer:
        """A `Dequantizer` of the weight for one pass."""


def slices(total: int, step: int, numel_per_index: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering `total` indices, starts at multiples of `step`, each holding at most
    `SLICE_NUMEL` weights when an index stands for `numel_per_index` of them (at least one step each)."""
    size = max(step, SLICE_NUMEL // max(numel_per_index, 1) // step * step)
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def forward_by_rows(slicer: Slicer, x: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ W[:out_features].T in x's dtype, W dequantized `SLICE_NUMEL` weights of rows at a time into one
    output: each output column needs only its row of W."""
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_empty(flat.shape[0], slicer.out_features)
    dequantizer = slicer.dequantizer()
    for start, stop in slices(slicer.out_features, 1, slicer.shape[1]):
        torch.mm(flat, dequantizer.rows(start, stop).to(flat.dtype).t(), out=out[:, start:stop])
    return out.view(*x.shape[:-1], slicer.out_features)


class _SlicedBackwardLinear(torch.autograd.Function):
    """y = the slicer's forward pass of x; the backward pass dequantizes W by slices of columns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slicer: Slicer) -> torch.Tensor:
        ctx.slicer, ctx.input_dtype, ctx.dtype = slicer, x.dtype, slicer.compute_dtype(x)
        return slicer.forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slicer, rows = ctx.slicer, ctx.slicer.out_features
        flat = grad.reshape(-1, rows).to(ctx.dtype)
        dequantizer = slicer.dequantizer()
        if not slicer.column_step:
            grad_x = flat @ dequantizer.rows(0, rows).to(flat.dtype)
        else:
            grad_x = flat.new_empty(flat.shape[0], slicer.shape[1])
            for start, stop in slices(slicer.shape[1], slicer.column_step, slicer.shape[0]):
                torch.mm(flat, dequantizer.columns(start, stop)[:rows].to(flat.dtype), out=grad_x[:, start:stop])
        return grad_x.view(*grad.shape[:-1], slicer.shape[1]).to(ctx.input_dtype), None


def sliced_linear(x: torch.Tensor, slicer: Slicer) -> torch.Tensor:
    """The slicer's layer applied to x; where x needs a gradient, through `_SlicedBackwardLinear`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _SlicedBackwardLinear.apply(x, slicer)
    return slicer.forward(x)
