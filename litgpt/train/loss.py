"""The losses a recipe trains with.

Next-token losses need the logits of every position, (batch x seq x vocab): at a vocabulary of 128k they outweigh all
other activations. So training never builds them whole: the model returns its final hidden states
(`GPT(idx, return_hidden=True)`, through the module's `__call__`, so wrappers' hooks run) and `chunked_head_loss`
applies the output head and the loss over chunks of positions. Its backward pass recomputes each chunk's logits, so at
most one chunk's logits (16-bit and float32) are alive at any time.

The chunking knows nothing of cross-entropy: a `ChunkLoss` turns one chunk's float32 logits and its targets into the
sum of its losses and, when asked, the gradient of that sum with respect to the logits. `cross_entropy_chunk` is the
one for next-token prediction; a distillation loss would be another (its targets a teacher's chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from litgpt.data.base import IGNORE_INDEX

# A chunk's float32 logits (positions, vocab), which it may overwrite, its targets, and whether the gradient is
# wanted -> (sum of the chunk's losses, d sum / d logits or None).
ChunkLoss = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, Optional[torch.Tensor]]]
LossFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# Fewer positions per chunk would not pay: every chunk reads and writes the head's whole weight gradient once.
MIN_CHUNK_POSITIONS = 1024


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions that have a label (0, not NaN, when none has: a fully masked batch)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor,
                        need_grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The `ChunkLoss` of `cross_entropy`: the summed cross-entropy of the labelled positions, and its gradient
    softmax - one_hot (zero rows where there is no label), computed in place over `logits`."""
    labelled = labels != IGNORE_INDEX
    index = torch.where(labelled, labels, 0).unsqueeze(1)
    picked = logits.gather(1, index).squeeze(1)
    maxes = logits.amax(dim=1, keepdim=True)
    exps = logits.sub_(maxes).exp_()  # in place: one float32 buffer per chunk
    sums = exps.sum(dim=1, keepdim=True)
    log_sum_exp = (maxes + sums.log()).squeeze(1)
    total = torch.where(labelled, log_sum_exp - picked, 0.0).sum()
    if not need_grad:
        return total, None
    grad = exps.div_(sums)
    grad.scatter_add_(1, index, torch.full_like(picked, -1.0).unsqueeze(1))
    return total, grad.mul_(labelled.unsqueeze(1))


def auto_chunk_size(positions: int, n_embd: int, vocab_size: int) -> int:
    """Positions per chunk when none is set: so many that one chunk's float32 logits are about the size of the
    micro-batch's hidden states (positions x n_embd), so the loss holds no more than the activation it follows, but
    at least MIN_CHUNK_POSITIONS (each chunk reads and writes the head's weight gradient, (vocab x n_embd), once: too
    many chunks make that traffic cost more than the matmuls) and at most all positions."""
    return min(positions, max(MIN_CHUNK_POSITIONS, math.ceil(positions * n_embd / vocab_size)))


@dataclass
class OutputHead:
    """The output head as tensors: logits = hidden @ weight.T + bias + lora_input @ lora_b.T, then soft-capped.

    `lora_input` (positions..., r) is a LoRA head's low-rank side, dropout(hidden) @ A.T * scaling, computed by
    ordinary autograd before the chunks (it is small), so its dropout needs no replay when a chunk is recomputed.
    """

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    lora_input: Optional[torch.Tensor] = None
    lora_b: Optional[torch.Tensor] = None
    softcap: Optional[float] = None

    @classmethod
    def of(cls, head: nn.Module, hidden: torch.Tensor, softcap: Optional[float] = None) -> "OutputHead":
        """The tensors of `head`: an `nn.Linear`, or a `litgpt.lora.LoRALinear` (its adapters' gradients flow)."""
        from litgpt.lora import LoRALinear

        if isinstance(head, LoRALinear) and not head.merged:
            lora_input, lora_b = head.low_rank(hidden)
            return cls(head.weight, head.bias, lora_input, lora_b, softcap)
        return cls(head.weight, head.bias, softcap=softcap)


def chunked_head_loss(hidden: torch.Tensor, head: OutputHead, targets: torch.Tensor, chunk_loss: ChunkLoss,
                      chunk_size: Optional[int] = None) -> torch.Tensor:
    """The sum of `chunk_loss` over every position of `head(hidden)`, the logits built one chunk of `chunk_size`
    positions at a time (None: `auto_chunk_size`) and never kept: the backward pass recomputes them.

    `targets` has `hidden`'s leading (batch, seq) dimensions. The head runs in the dtype autocast gives a linear
    layer where autocast is on (as the model's own layers did), else in the hidden states' dtype; the loss in float32.
    The gradients reach the head's own parameters, as any layer's do.
    """
    positions = hidden.shape[:-1].numel()
    if chunk_size is None:
        chunk_size = auto_chunk_size(positions, hidden.size(-1), head.weight.size(0))
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    lora_input = None if head.lora_input is None else head.lora_input.flatten(0, -2)
    return _ChunkedHead.apply(
        hidden.flatten(0, -2), head.weight, head.bias, lora_input, head.lora_b,
        targets.flatten(0, hidden.dim() - 2), chunk_loss, head.softcap, dtype, max(1, chunk_size),
    )


class _HeadInDtype:
    """The head's tensors cast once to the compute dtype, and the float32 logits of a chunk of positions."""

    def __init__(self, weight, bias, lora_input, lora_b, softcap: Optional[float], dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.lora_input, self.lora_b = lora_input, None if lora_b is None else lora_b.to(dtype)
        self.softcap, self.dtype = softcap, dtype

    def logits(self, x: torch.Tensor, rows: slice) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(float32 logits of the chunk, and with soft-capping the tanh they are capped with, for the backward)."""
        out = F.linear(x, self.weight, self.bias)
        if self.lora_b is not None:
            out.addmm_(self.lora_input[rows].to(self.dtype), self.lora_b.t())
        logits = out.float()
        del out  # a 16-bit head: free its copy before the float32 math
        if self.softcap is None:
            return logits, None
        tanh = logits.div_(self.softcap).tanh_()
        return tanh * self.softcap, tanh


def _add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """accumulator += a @ b, in the accumulator's dtype (in one kernel where the dtypes agree)."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
    else:
        accumulator.add_(a @ b)


class _ChunkedHead(torch.autograd.Function):
    """Forward: the summed loss, chunk by chunk, nothing kept but the inputs. Backward: each chunk's logits again,
    their gradient from the chunk loss, and its products into the gradients of the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_input, lora_b, targets, chunk_loss, softcap, dtype, chunk_size):
        ctx.save_for_backward(hidden, weight, bias, lora_input, lora_b, targets)
        ctx.chunk_loss, ctx.softcap, ctx.dtype, ctx.chunk_size = chunk_loss, softcap, dtype, chunk_size
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
            head = _HeadInDtype(weight, bias, lora_input, lora_b, softcap, dtype)
            total = torch.zeros((), device=hidden.device, dtype=torch.float32)
            for rows in _chunks(hidden.size(0), chunk_size):
                logits, _ = head.logits(hidden[rows].to(dtype), rows)
                total += chunk_loss(logits, targets[rows], False)[0]
                del logits  # before the next chunk's are made
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, lora_input, lora_b, targets = ctx.saved_tensors
        needs = ctx.needs_input_grad
        head = _HeadInDtype(weight, bias, lora_input, lora_b, ctx.softcap, ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs[2] else None
        grad_lora_input = torch.empty_like(lora_input) if needs[3] else None
        grad_lora_b = torch.zeros_like(lora_b) if needs[4] else None
        for rows in _chunks(hidden.size(0), ctx.chunk_size):
            x = hidden[rows].to(ctx.dtype)
            logits, tanh = head.logits(x, rows)
            _, grad = ctx.chunk_loss(logits, targets[rows], True)
            if tanh is not None:  # d(cap * tanh(l / cap)) / dl = 1 - tanh^2
                grad.mul_(tanh.square_().neg_().add_(1))
                del tanh
            grad = grad.mul_(grad_total).to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ head.weight
            if grad_weight is not None:
                _add_product(grad_weight, grad.t(), x)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=torch.float32)
            if grad_lora_input is not None:
                grad_lora_input[rows] = grad @ head.lora_b
            if grad_lora_b is not None:
                _add_product(grad_lora_b, grad.t(), lora_input[rows].to(ctx.dtype))
            del x, logits, grad  # before the next chunk's are made
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, grad_lora_input, grad_lora_b, None, None, None, None, None


def _chunks(positions: int, chunk_size: int):
    for start in range(0, positions, chunk_size):
        yield slice(start, min(start + chunk_size, positions))


# ---- the losses of a model ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loss:
    """A loss both ways: on whole logits, and per chunk for `chunked_head_loss`; both average over the positions
    that have a label."""

    on_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_chunk: ChunkLoss


LOSSES = {"cross_entropy": Loss(cross_entropy, cross_entropy_chunk)}


def model_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss: Loss,
               chunk_size: Optional[int] = None) -> torch.Tensor:
    """The mean of `loss` over the labelled positions of a `GPT` (or Fabric's wrapper of one), its logits built
    chunk by chunk (`chunked_head_loss`) from the final hidden states the model's forward returns."""
    from litgpt.checkpoint.manager import unwrap

    gpt = unwrap(model)
    hidden = model(input_ids, return_hidden=True)
    head = OutputHead.of(gpt.lm_head, hidden, gpt.config.final_logit_softcapping)
    total = chunked_head_loss(hidden, head, labels, loss.per_chunk, chunk_size)
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def loss_function(name: str, chunk_size: Optional[int] = None, chunked: bool = True) -> LossFunction:
    """loss(model, input_ids, labels) for the loss `name` of LOSSES: chunked (`model_loss`, `chunk_size` positions
    per chunk, None: automatic), or on the model's whole logits (a compiled module whose head is not callable from
    outside, extensions/thunder)."""
    loss = LOSSES[name]
    if not chunked:
        return lambda model, input_ids, labels: loss.on_logits(model(input_ids), labels)
    return lambda model, input_ids, labels: model_loss(model, input_ids, labels, loss, chunk_size)
