"""The losses a recipe trains with.

Next-token losses need the logits of every position, (batch x seq x vocab): at a vocabulary of 128k they outweigh all
other activations. So training never builds them whole: the model returns its final hidden states
(`GPT(idx, return_hidden=True)`, through the module's `__call__`, so wrappers' hooks run) and `chunked_head_loss`
applies the output head and the loss over chunks of positions, so at most one chunk's logits (16-bit and float32) are
alive at any time. A summed loss computes its gradients chunk by chunk in the forward pass, while it has the chunk's
logits; a per-position one (preference optimization) recomputes each chunk's logits in its backward pass.

The chunking knows nothing of cross-entropy: a `ChunkLoss` turns one chunk's float32 logits and its targets into the
sum of its losses and, when asked, the gradient of that sum with respect to the logits. `cross_entropy_chunk` is the
one for next-token prediction; `DistillationChunkLoss` is another: its targets are the labels and the teacher's final
hidden states, from which it builds the teacher's logits of the same chunk, so neither model's whole logits exist.

Under tensor parallelism the head is split by vocabulary rows: `OutputHead.of` keeps each rank's rows and its
`VocabularyShard`, and the chunk losses that take one (`nll_chunk`, so cross-entropy and preference optimization)
combine each position's maximum, sum of exponentials and label logit over the group, so no rank builds a chunk's
logits over the whole vocabulary (distillation, whose divergence needs every row of both models, gathers the head).

A loss function returns `Losses`: "loss", what the backward pass runs on, and the parts it is made of for the logs
(`ce_loss`, `kd_loss`, a mixture-of-experts router's `aux_loss`), detached.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from litgpt.args import KDArgs
from litgpt.data.base import IGNORE_INDEX
from litgpt.precision import compute_dtype

# Per-position targets: one tensor, or a tuple of them, each with the hidden states' leading (batch, seq) dimensions.
Targets = Union[torch.Tensor, tuple[torch.Tensor, ...]]
# A chunk's float32 logits (positions, vocab), which it may overwrite, its targets (sliced like the logits), and
# whether the gradient is wanted -> (sum of the chunk's losses, d sum / d logits or None).
ChunkLoss = Callable[[torch.Tensor, Targets, bool], tuple[torch.Tensor, Optional[torch.Tensor]]]
# "loss" (what the backward pass runs on) and, where it has several, its parts (detached), by name.
Losses = dict[str, torch.Tensor]
# loss(model, input_ids, labels, positions=None): `positions` (B, T) are packed samples' own token positions
# (`litgpt.data.packing`), which the model's forward takes as `sample_positions`.
LossFunction = Callable[..., Losses]

# Fewer positions per chunk would not pay: every chunk reads and writes the head's whole weight gradient once.
MIN_CHUNK_POSITIONS = 1024


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """How many positions have a label, at least 1 (a fully masked batch has a loss of 0, not NaN)."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


def packed(positions: Optional[torch.Tensor]) -> dict:
    """The model's keyword argument for packed samples' positions (none for unpacked data, so a model or a compiled
    module that knows nothing of packing is called as before)."""
    return {} if positions is None else {"sample_positions": positions}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions that have a label (0, not NaN, when none has: a fully masked batch)."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / labelled_positions(labels)


@dataclass(frozen=True)
class VocabularyShard:
    """The vocabulary rows [start, start + rows of the logits) whose logits this rank computes, of a head split by
    tensor parallelism over the ranks of `mesh` (1-D): a chunk loss that takes a shard (`nll_chunk`) combines each
    position's maximum, sum of exponentials and label logit over the group (three all-reduces of one number per
    position), so no rank builds logits over the whole vocabulary."""

    mesh: object
    start: int

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.mesh.get_group())
        return tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> Optional["VocabularyShard"]:
        """The shard of a head's `weight` split by vocabulary rows over a 1-D mesh (tensor parallelism), else None."""
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or weight.placements != (Shard(0),):
            return None
        mesh = weight.device_mesh
        return cls(mesh, mesh.get_local_rank() * (weight.size(0) // mesh.size()))


def nll_chunk(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool,
              shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The negative log-likelihood of each position's label (0 where there is none), and its gradient
    softmax - one_hot (zero rows where there is no label), computed in place over `logits`: the per-position
    `ChunkLoss` of which cross-entropy sums the positions and preference optimization sums each sequence's. With a
    `shard`, `logits` are its vocabulary rows' and so is the gradient; the values are the whole vocabulary's."""
    labelled = labels != IGNORE_INDEX
    mine = labelled
    if shard is not None:
        labels = labels - shard.start
        mine = labelled & (labels >= 0) & (labels < logits.size(1))
    index = torch.where(mine, labels, 0).unsqueeze(1)
    picked = logits.gather(1, index).squeeze(1)
    maxes = logits.amax(dim=1, keepdim=True)
    if shard is not None:
        import torch.distributed as dist

        picked = shard.all_reduce(torch.where(mine, picked, 0.0))  # from the rank that holds the label's row
        shard.all_reduce(maxes, dist.ReduceOp.MAX)
    exps = logits.sub_(maxes).exp_()  # in place: one float32 buffer per chunk
    sums = exps.sum(dim=1, keepdim=True)
    if shard is not None:
        shard.all_reduce(sums)
    log_sum_exp = (maxes + sums.log()).squeeze(1)
    per_position = torch.where(labelled, log_sum_exp - picked, 0.0)
    if not need_grad:
        return per_position, None
    grad = exps.div_(sums)
    grad.scatter_add_(1, index, mine.to(grad.dtype).neg().unsqueeze(1))  # the logits' dtype (bf16-true)
    return per_position, grad.mul_(labelled.unsqueeze(1))


def cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool,
                        shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The `ChunkLoss` of `cross_entropy`: the summed cross-entropy of the labelled positions (`nll_chunk`) and its
    gradient."""
    per_position, grad = nll_chunk(logits, labels, need_grad, shard)
    return per_position.sum(), grad


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
    shard: Optional[VocabularyShard] = None  # a head split by vocabulary rows: the tensors are this rank's rows'

    @classmethod
    def of(cls, head: nn.Module, hidden: torch.Tensor, softcap: Optional[float] = None,
           split: bool = True) -> "OutputHead":
        """The tensors of `head`: an `nn.Linear`, or a `litgpt.lora.LoRALinear` (its adapters' gradients flow).

        A head split by tensor parallelism over its vocabulary rows stays split (`split`, `split_head`): its chunk
        losses must take the `shard` (`nll_chunk`). With `split=False` (a chunk loss that needs whole logits,
        distillation's) it is gathered whole (differentiably: each rank of the group computes the same loss of the
        same batch, and keeps its own rows of the gradient)."""
        from litgpt.distributed.dtensor import gather_full
        from litgpt.lora import LoRALinear

        shard = VocabularyShard.of(head.weight) if split else None
        if shard is not None:
            return split_head(head, hidden, softcap, shard)
        if isinstance(head, LoRALinear) and head.applies_update:
            lora_input, lora_b = head.low_rank(hidden)
            return cls(head.weight, head.bias, lora_input, lora_b, softcap)
        bias = None if head.bias is None else gather_full(head.bias)
        return cls(gather_full(head.weight), bias, softcap=softcap)


def split_head(head: nn.Module, hidden: torch.Tensor, softcap: Optional[float], shard: VocabularyShard) -> OutputHead:
    """`OutputHead.of` a head split by vocabulary rows: this rank's rows of its weight, bias and LoRA B; a LoRA
    head's low-rank side from its whole A, its gradient summed over the group (each rank's rows give their share)."""
    from torch.distributed.tensor import DTensor

    from litgpt.distributed.dtensor import summed_gradient
    from litgpt.distributed.plans.styles import local_views
    from litgpt.lora import LoRALinear

    bias = None if head.bias is None else head.bias.to_local()
    if not (isinstance(head, LoRALinear) and head.applies_update):
        return OutputHead(head.weight.to_local(), bias, softcap=softcap, shard=shard)
    (_, _, _, a, b), = head.lora_factors()  # a head has one part: all of its rows
    with local_views([(head, name, DTensor.to_local) for name, _ in head.named_parameters(recurse=False)
                      if name.startswith("lora_A")]):
        lora_input = summed_gradient(head.adapter_input(hidden), shard.mesh)
    return OutputHead(head.weight.to_local(), bias, lora_input, b.to_local(), softcap, shard)


def head_loss(gpt: nn.Module, hidden: torch.Tensor, targets: Targets, chunk_loss: ChunkLoss,
              chunk_size: Optional[int] = None, per_position: bool = False, split: bool = True) -> torch.Tensor:
    """`chunked_head_loss` of `gpt`'s output head (`OutputHead.of`, `split` as there) on its final `hidden` states,
    run within the head's FSDP unit where it is one (`litgpt.distributed.fsdp.head_unit`: its weights gathered for
    the loss only, its gradient reduce-scattered as soon as the loss's backward pass has made it)."""
    from torch.distributed.fsdp import FSDPModule

    def loss(hidden: torch.Tensor, targets: Targets) -> torch.Tensor:
        head = OutputHead.of(gpt.lm_head, hidden, gpt.config.final_logit_softcapping, split=split)
        return chunked_head_loss(hidden, head, targets, chunk_loss, chunk_size, per_position)

    if not isinstance(gpt.lm_head, FSDPModule):
        return loss(hidden, targets)
    from litgpt.distributed.fsdp import call_in_unit

    return call_in_unit(gpt.lm_head, loss, hidden, targets)


def chunked_head_loss(hidden: torch.Tensor, head: OutputHead, targets: Targets, chunk_loss: ChunkLoss,
                      chunk_size: Optional[int] = None, per_position: bool = False) -> torch.Tensor:
    """The sum of `chunk_loss` over every position of `head(hidden)`, the logits built one chunk of `chunk_size`
    positions at a time (None: `auto_chunk_size`) and never kept (see `_ChunkedHead`). With
    `per_position`, `chunk_loss` gives one value per position (not their sum) and so does this: a tensor of
    `hidden`'s leading dimensions, whose gradient may differ from position to position.

    `targets` (a tensor or a tuple of them) has `hidden`'s leading (batch, seq) dimensions; each chunk gets its rows.
    The head runs in `compute_dtype(hidden)` (autocast's where it is on, as the model's own layers did); the loss in
    float32. The gradients reach the head's own parameters, as any layer's do. A head split by vocabulary rows
    (`head.shard`) gives `chunk_loss` its rows' logits and the shard; the hidden states' gradient, each rank's
    share, is summed over the group.
    """
    if head.shard is not None:
        from litgpt.distributed.dtensor import summed_gradient

        chunk_loss = functools.partial(chunk_loss, shard=head.shard)
        hidden = summed_gradient(hidden, head.shard.mesh)
    positions = hidden.shape[:-1].numel()
    if chunk_size is None:
        chunk_size = auto_chunk_size(positions, hidden.size(-1), head.weight.size(0))
    lora_input = None if head.lora_input is None else head.lora_input.flatten(0, -2)
    leading = hidden.dim() - 2
    as_tuple = isinstance(targets, tuple)
    flat_targets = tuple(t.flatten(0, leading) for t in targets) if as_tuple else (targets.flatten(0, leading),)
    inputs = (hidden, head.weight, head.bias, lora_input, head.lora_b)
    # Compiled, the recomputing form is the faster (inductor fuses the chunk's softmax and its gradient into the
    # backward's kernels); eager, taking the gradients now saves the head's second matmul and softmax.
    grads_now = (not per_position and not torch.compiler.is_compiling() and torch.is_grad_enabled()
                 and not _BACKWARD_IN_PARTS.active and any(t is not None and t.requires_grad for t in inputs))
    total = _ChunkedHead.apply(
        hidden.flatten(0, -2), head.weight, head.bias, lora_input, head.lora_b, chunk_loss, head.softcap,
        compute_dtype(hidden), max(1, chunk_size), as_tuple, per_position, grads_now, *flat_targets,
    )
    return total.view(hidden.shape[:-1]) if per_position else total


class _ThreadFlag(threading.local):
    """A setting of the thread that builds the losses, on within `_raised`."""

    active = False


@contextlib.contextmanager
def _raised(flag: _ThreadFlag):
    flag.active = True
    try:
        yield
    finally:
        flag.active = False


_BACKWARD_IN_PARTS = _ThreadFlag()
_COMPILED_CHUNKS = _ThreadFlag()


def backward_in_parts():
    """Within it, the losses built will be differentiated in more than one backward pass (a zero-bubble pipeline
    schedule takes the inputs' gradients first and the weights' later, each through the whole graph): the chunked
    head keeps its inputs and makes each chunk's logits again in the backward pass, instead of taking its gradients
    in the forward pass, which one backward pass uses up."""
    return _raised(_BACKWARD_IN_PARTS)



class _HeadInDtype:
    """The head's tensors cast once to the compute dtype, and the float32 logits of a chunk of positions."""

    def __init__(self, weight, bias, lora_input, lora_b, softcap: Optional[float], dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.lora_input, self.lora_b = lora_input, None if lora_b is None else lora_b.to(dtype)
        self.softcap, self.dtype = softcap, dtype

    def product(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """The chunk's logits before soft-capping, in the head's dtype."""
        out = F.linear(x, self.weight, self.bias)
        if self.lora_b is not None:
            out.addmm_(self.lora_input[rows].to(self.dtype), self.lora_b.t())
        return out

    def logits(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """The chunk's float32 logits, soft-capped."""
        logits = self.product(x, rows).float()
        return logits if self.softcap is None else logits.div_(self.softcap).tanh_().mul_(self.softcap)


def _add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """accumulator += a @ b, in the accumulator's dtype, in one kernel where the dtypes agree or the device's matmul
    writes the accumulator's dtype from 16-bit operands (CUDA: a float32 accumulator of a bf16 head's weight
    gradient, where adding a 16-bit product cost as much as the matmul and rounded each chunk's share)."""
    if accumulator.dtype == a.dtype:
        accumulator.addmm_(a, b)
        return
    if accumulator.is_cuda:
        try:
            torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
            return
        except (TypeError, RuntimeError):  # torch < 2.8 has no out_dtype
            pass
    accumulator.add_(a @ b)


class _HeadGradients:
    """The gradients of the hidden states and of the head's tensors that `_ChunkedHead` accumulates chunk by chunk
    (None where an input needs none)."""

    def __init__(self, needs: tuple, hidden, weight, bias, lora_input, lora_b) -> None:
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = torch.zeros_like(weight) if needs[1] else None
        self.bias = torch.zeros_like(bias, dtype=torch.float32) if needs[2] else None
        self.lora_input = torch.empty_like(lora_input) if needs[3] else None
        self.lora_b = torch.zeros_like(lora_b) if needs[4] else None

    def add_chunk(self, head: _HeadInDtype, x: torch.Tensor, grad: torch.Tensor, rows: slice, lora_input) -> None:
        """Add the products of one chunk's logits gradient `grad` (in the head's dtype) with its inputs `x`."""
        if self.hidden is not None:
            self.hidden[rows] = grad @ head.weight
        if self.weight is not None:
            _add_product(self.weight, grad.t(), x)
        if self.bias is not None:
            self.bias += grad.sum(0, dtype=torch.float32)
        if self.lora_input is not None:
            self.lora_input[rows] = grad @ head.lora_b
        if self.lora_b is not None:
            _add_product(self.lora_b, grad.t(), lora_input[rows].to(head.dtype))

    def result(self, bias_dtype: Optional[torch.dtype], scale: Optional[torch.Tensor] = None) -> tuple:
        """The five gradients (times `scale`, the loss' incoming gradient, where given), the bias' in its dtype."""
        grads = [self.hidden, self.weight, self.bias, self.lora_input, self.lora_b]
        if scale is not None:
            grads = [None if g is None else g.mul_(scale) for g in grads]
        if grads[2] is not None:
            grads[2] = grads[2].to(bias_dtype)
        return tuple(grads)


class _ChunkedHead(torch.autograd.Function):
    """The summed loss, chunk by chunk, with no chunk's logits kept.

    A summed loss (not `per_position`) that will be differentiated computes its gradients in the forward pass too,
    from the same chunk logits (the loss' incoming gradient is a scalar, applied in the backward pass): the head's
    matmul runs once, not again in the backward pass. Otherwise the forward pass keeps only the inputs, and the
    backward pass makes each chunk's logits again, their gradient from the chunk loss, and its products into the
    gradients of the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, lora_input, lora_b, chunk_loss, softcap, dtype, chunk_size, as_tuple,
                per_position, grads_now, *targets):
        ctx.chunk_loss, ctx.softcap, ctx.dtype, ctx.chunk_size = chunk_loss, softcap, dtype, chunk_size
        ctx.as_tuple, ctx.per_position, ctx.n_targets = as_tuple, per_position, len(targets)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.loss_of_chunk = loss_of_chunk = _loss_of_chunk_function(chunk_loss)  # backward: another thread
        grads = _HeadGradients(ctx.needs_input_grad, hidden, weight, bias, lora_input, lora_b) if grads_now else None
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
            head = _HeadInDtype(weight, bias, lora_input, lora_b, softcap, dtype)
            shape = (hidden.size(0),) if per_position else ()
            total = torch.zeros(shape, device=hidden.device, dtype=torch.float32)
            for rows in _chunks(hidden.size(0), chunk_size):
                values, grad, x = _chunk(head, hidden, rows, targets, chunk_loss, as_tuple, grads is not None,
                                         loss_of_chunk)
                if grads is not None:
                    grads.add_chunk(head, x, grad, rows, lora_input)
                if per_position:
                    total[rows] = values
                else:
                    total += values
                del grad, x  # before the next chunk's are made
        ctx.grads = grads
        if grads is None:
            ctx.save_for_backward(hidden, weight, bias, lora_input, lora_b, *targets)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        no_grads = (None,) * (7 + ctx.n_targets)  # chunk_loss .. grads_now, and the targets
        if ctx.grads is not None:
            grads, ctx.grads = ctx.grads, None  # scaled in place: a second backward pass would need them again
            return *grads.result(ctx.bias_dtype, grad_total), *no_grads
        if not ctx.saved_tensors:
            raise RuntimeError("The chunked loss' gradients were computed in its forward pass and used once already: "
                               "a second backward pass (retain_graph=True) needs the loss computed again.")
        hidden, weight, bias, lora_input, lora_b, *targets = ctx.saved_tensors
        head = _HeadInDtype(weight, bias, lora_input, lora_b, ctx.softcap, ctx.dtype)
        grads = _HeadGradients(ctx.needs_input_grad, hidden, weight, bias, lora_input, lora_b)
        for rows in _chunks(hidden.size(0), ctx.chunk_size):
            scale = grad_total[rows].unsqueeze(1) if ctx.per_position else grad_total
            _, grad, x = _chunk(head, hidden, rows, targets, ctx.chunk_loss, ctx.as_tuple, True, ctx.loss_of_chunk,
                                scale)
            grads.add_chunk(head, x, grad, rows, lora_input)
            del x, grad  # before the next chunk's are made
        return *grads.result(ctx.bias_dtype), *no_grads


def _chunk(head: _HeadInDtype, hidden, rows: slice, targets, chunk_loss: ChunkLoss, as_tuple: bool, need_grad: bool,
           loss_of_chunk: Callable, scale: Optional[torch.Tensor] = None):
    """One chunk: (the chunk loss' values, with `need_grad` the gradient of their sum (times `scale`) with respect to
    the head's product in its dtype, and the chunk's hidden states in the head's dtype)."""
    x = hidden[rows].to(head.dtype)
    values, grad = loss_of_chunk(head.product(x, rows), _target_rows(targets, rows, as_tuple), chunk_loss,
                                 head.softcap, need_grad, scale)
    return values, grad, x


def _loss_of_chunk(product: torch.Tensor, targets: Targets, chunk_loss: ChunkLoss, softcap: Optional[float],
                   need_grad: bool, scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`chunk_loss` of the chunk's float32 logits, made from the head's `product` (soft-capped where the model caps
    them), and with `need_grad` the gradient of its sum with respect to `product`, times `scale`, in its dtype."""
    dtype = product.dtype
    logits = product.float()
    del product  # a 16-bit head: free its copy before the float32 math
    tanh = None
    if softcap is not None:
        tanh = logits.div_(softcap).tanh_()
        logits = tanh * softcap
    values, grad = chunk_loss(logits, targets, need_grad)
    if grad is None:
        return values, None
    if tanh is not None:  # d(cap * tanh(l / cap)) / dl = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1))
    if scale is not None:
        grad.mul_(scale)
    return values, grad.to(dtype)


def compiled_chunk_losses():
    """Within it, the chunked head runs each chunk's loss and gradient (`_loss_of_chunk`: the float32 logits, the
    softmax, the gradient in the head's dtype) as one compiled function, where the chunk loss is a plain function
    (`cross_entropy_chunk`, `nll_chunk`; not one split over ranks, nor distillation's, which keeps sums): eager,
    its passes over the chunk's float32 logits took a third of the head's time on a GPU
    (benchmarks/gpu_profile.py)."""
    return _raised(_COMPILED_CHUNKS)


def _loss_of_chunk_function(chunk_loss: ChunkLoss) -> Callable:
    if _COMPILED_CHUNKS.active and inspect.isfunction(chunk_loss) and not torch.compiler.is_compiling():
        return _compiled_loss_of_chunk()
    return _loss_of_chunk


@functools.cache
def _compiled_loss_of_chunk() -> Callable:
    return torch.compile(_loss_of_chunk)


def _chunks(positions: int, chunk_size: int):
    for start in range(0, positions, chunk_size):
        yield slice(start, min(start + chunk_size, positions))


def _target_rows(targets, rows: slice, as_tuple: bool) -> Targets:
    """The chunk's rows of the targets, in the form the caller gave them (a tensor, or a tuple of tensors)."""
    return tuple(t[rows] for t in targets) if as_tuple else targets[0][rows]


# ---- distillation: a teacher's chunk of logits beside the student's --------------------------------------------------
def distillation_chunk(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, kd: KDArgs,
                       need_grad: bool, shard: Optional[VocabularyShard] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The KD and cross-entropy sums of one chunk's labelled positions, and the gradient of
    alpha x KD + (1 - alpha) x CE with respect to the student's logits (zero rows where there is no label).

    `student` and `teacher` are float32 logits (positions, vocab), both overwritten (the caller keeps no other
    reference to `teacher`, whose buffer becomes the teacher's log-probabilities). KD is the divergence `kd.loss`
    between softmax(logits / T) of the two, times T^2; its gradient with respect to the logits is then T times its
    gradient with respect to logits / T (the closed forms of `KD_TERMS`). At most five float32 (positions, vocab)
    buffers are alive at once. With a `shard` (tensor parallelism) both models' logits are this rank's vocabulary rows'
    and so is the gradient; each position's normalizers and sums are taken over the group, so the values are the
    whole vocabulary's."""
    labelled = labels != IGNORE_INDEX
    t = kd.temperature
    softened = student / t
    # the student's softened distribution
    log_q = torch.log_softmax(softened, dim=1) if shard is None else softened.sub_(log_sum_exp(softened, shard))
    teacher = teacher.div_(t)
    log_p = teacher.sub_(log_sum_exp(teacher, shard))  # the teacher's, in place
    # over `student`, in place
    ce_sum, ce_grad = cross_entropy_chunk(student, labels, need_grad and kd.alpha < 1, shard)
    kd_rows, kd_grad = KD_TERMS[kd.loss](log_q, log_p, need_grad and kd.alpha > 0, shard)
    kd_sum = torch.where(labelled, kd_rows, 0.0).sum() * (t * t)
    if not need_grad:
        return kd_sum, ce_sum, None
    if kd_grad is None:  # alpha 0: the cross-entropy alone
        return kd_sum, ce_sum, ce_grad
    grad = kd_grad.mul_(labelled.unsqueeze(1) * (kd.alpha * t))
    if ce_grad is not None:
        grad.add_(ce_grad, alpha=1 - kd.alpha)
    return kd_sum, ce_sum, grad


def log_sum_exp(logits: torch.Tensor, shard: Optional[VocabularyShard] = None) -> torch.Tensor:
    """Each position's log-sum-exp of `logits` (positions, vocab), as a column; over the group's vocabulary rows
    with a `shard` (its maximum and its sum of exponentials all-reduced)."""
    if shard is None:
        return logits.logsumexp(dim=1, keepdim=True)
    import torch.distributed as dist

    maxes = shard.all_reduce(logits.amax(dim=1, keepdim=True), dist.ReduceOp.MAX)
    sums = shard.all_reduce(torch.exp(logits - maxes).sum(dim=1, keepdim=True))
    return maxes + sums.log()


def row_sums(x: torch.Tensor, shard: Optional[VocabularyShard] = None) -> torch.Tensor:
    """Each position's sum of `x` (positions, vocab); over the group's vocabulary rows with a `shard`."""
    sums = x.sum(1)
    return sums if shard is None else shard.all_reduce(sums)


# The divergences between the student's softened distribution q and the teacher's p, from their log-probabilities,
# which they overwrite: per position, and with `need_grad` the gradient with respect to the student's softened logits
# u (q = softmax(u)). Through the softmax, d/du_j of D(q) is q_j (g_j - <q, g>) with g = dD/dq.
def forward_kl(log_q: torch.Tensor, log_p: torch.Tensor, need_grad: bool,
               shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KL(p || q) = sum p (log p - log q); its gradient q - p."""
    log_p_over_q = log_p - log_q
    p = log_p.exp_()
    rows = row_sums(log_p_over_q.mul_(p), shard)
    return rows, log_q.exp_().sub_(p) if need_grad else None


def reverse_kl(log_q: torch.Tensor, log_p: torch.Tensor, need_grad: bool,
               shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KL(q || p) = sum q g with g = log q - log p; its gradient q (g - KL)."""
    qg = torch.sub(log_q, log_p)
    q = log_q.exp_()
    rows = row_sums(qg.mul_(q), shard)
    return rows, qg.addcmul_(q, rows.unsqueeze(1), value=-1) if need_grad else None


def jensen_shannon(log_q: torch.Tensor, log_p: torch.Tensor, need_grad: bool,
                   shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """JS = (KL(q || m) + KL(p || m)) / 2 with m = (q + p) / 2; its gradient q (g - <q, g>) with
    g = (log q - log m) / 2, so <q, g> = KL(q || m) / 2."""
    log_m = torch.logaddexp(log_q, log_p).sub_(math.log(2.0))
    p = log_p.exp()
    kl_p = row_sums(log_p.sub_(log_m).mul_(p), shard)
    del p
    q = log_q.exp()
    q_log_q_over_m = log_q.sub_(log_m).mul_(q)
    del log_m
    kl_q = row_sums(q_log_q_over_m, shard)
    rows = (kl_q + kl_p) / 2
    if not need_grad:
        return rows, None
    return rows, q_log_q_over_m.addcmul_(q, kl_q.unsqueeze(1), value=-1).mul_(0.5)


KD_TERMS = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "js": jensen_shannon}


class DistillationChunkLoss:
    """The `ChunkLoss` of distillation: the sum of alpha x KD + (1 - alpha) x CE over the chunk's labelled positions.

    Its targets are (labels, teacher): the teacher's final hidden states when `teacher_head` is given (the teacher's
    logits of the chunk are built here, in float32, soft-capped as the teacher's model caps them), else the teacher's
    logits. Each call also adds the two terms to sums for the logs, which `losses` reads after the forward pass (a
    backward pass that calls again, recomputing, comes after that).
    """

    def __init__(self, kd: KDArgs, teacher_head: Optional[_HeadInDtype] = None) -> None:
        self.kd, self.teacher_head = kd, teacher_head
        self.kd_sum = self.ce_sum = 0.0

    def __call__(self, logits: torch.Tensor, targets: Targets, need_grad: bool,
                 shard: Optional[VocabularyShard] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        labels, teacher = targets
        kd_sum, ce_sum, grad = distillation_chunk(logits, self.teacher_logits(teacher), labels, self.kd, need_grad,
                                                  shard)
        self.kd_sum, self.ce_sum = self.kd_sum + kd_sum.detach(), self.ce_sum + ce_sum.detach()
        return self.kd.alpha * kd_sum + (1 - self.kd.alpha) * ce_sum, grad

    def teacher_logits(self, teacher: torch.Tensor) -> torch.Tensor:
        """The teacher's float32 logits of the chunk, a buffer of their own."""
        if self.teacher_head is None:
            return teacher.to(torch.float32, copy=True)
        return self.teacher_head.logits(teacher.to(self.teacher_head.dtype), slice(None))

    def losses(self, total: torch.Tensor, labelled: torch.Tensor) -> Losses:
        """The loss and its two parts as means over the `labelled` positions, from the summed `total`."""
        return {"loss": total / labelled, "kd_loss": self.kd_sum / labelled, "ce_loss": self.ce_sum / labelled}


class _OnWholeLogits(torch.autograd.Function):
    """A `ChunkLoss` applied to whole logits as one chunk (a module compiled whole, whose head the loss cannot apply
    itself): forward its sum, backward its closed-form gradient."""

    @staticmethod
    def forward(ctx, logits, chunk_loss, *targets):
        ctx.save_for_backward(logits, *targets)
        ctx.chunk_loss = chunk_loss
        return chunk_loss(logits.flatten(0, -2).to(torch.float32, copy=True), targets, False)[0]

    @staticmethod
    def backward(ctx, grad_total):
        logits, *targets = ctx.saved_tensors
        _, grad = ctx.chunk_loss(logits.flatten(0, -2).to(torch.float32, copy=True), tuple(targets), True)
        return grad.mul_(grad_total).view_as(logits).to(logits.dtype), None, *(None,) * len(targets)


def teacher_head(teacher: nn.Module, hidden: torch.Tensor, split: bool = False) -> _HeadInDtype:
    """The teacher's output head as whole tensors in `compute_dtype(hidden)`, after the teacher's forward: a sharded
    teacher's root keeps them gathered (`Recipe.frozen_model`); one still sharded is gathered here (a
    collective) for this micro-batch's loss. `split`: this rank's vocabulary rows of a head split by tensor
    parallelism (`shared_vocabulary_shard`)."""
    from litgpt.distributed.dtensor import gather_full

    head = teacher.lm_head
    local = (lambda tensor: tensor.to_local()) if split else gather_full
    with torch.no_grad():
        bias = None if head.bias is None else local(head.bias)
        return _HeadInDtype(local(head.weight), bias, None, None, teacher.config.final_logit_softcapping,
                            compute_dtype(hidden))


def shared_vocabulary_shard(student_head: nn.Module, teacher_head: nn.Module) -> bool:
    """Whether the student's and the teacher's heads are split alike by vocabulary rows (tensor parallelism of both):
    then each rank's distillation loss runs on its rows of both (`distillation_chunk` with the shard). A head that is
    an FSDP unit of its own is never split so (`litgpt.distributed.fsdp.head_unit`): outside the loss, its weight is
    FSDP's shard of rows."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(student_head, FSDPModule):
        return False
    shard = VocabularyShard.of(student_head.weight)
    return (shard is not None and shard == VocabularyShard.of(teacher_head.weight)
            and student_head.weight.shape == teacher_head.weight.shape)


def distillation_loss(model: nn.Module, teacher: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      kd: KDArgs, chunk_size: Optional[int] = None, positions: Optional[torch.Tensor] = None) -> Losses:
    """alpha x KD + (1 - alpha) x CE of the student `model` (a `GPT` or Fabric's wrapper of one) against the frozen
    `teacher`, means over the labelled positions, chunk by chunk: the teacher's forward gives its final hidden states
    once (no gradient) and each chunk builds both models' logits of its positions only (under tensor parallelism of
    both, of this rank's vocabulary rows only)."""
    from litgpt.checkpoint.manager import unwrap

    with torch.no_grad():
        teacher_hidden = teacher(input_ids, return_hidden=True, **packed(positions))
    gpt = unwrap(model)
    split = shared_vocabulary_shard(gpt.lm_head, teacher.lm_head)
    chunk_loss = DistillationChunkLoss(kd, teacher_head(teacher, teacher_hidden, split))
    hidden = model(input_ids, return_hidden=True, **packed(positions))
    total = head_loss(gpt, hidden, (labels, teacher_hidden), chunk_loss, chunk_size, split=split)
    return with_router_aux_loss(model, chunk_loss.losses(total, labelled_positions(labels)))


def distillation_loss_on_logits(model: nn.Module, teacher: nn.Module, input_ids: torch.Tensor,
                                labels: torch.Tensor, kd: KDArgs, positions: Optional[torch.Tensor] = None) -> Losses:
    """`distillation_loss` on both models' whole logits (a student module compiled whole, extensions/thunder)."""
    with torch.no_grad():
        teacher_logits = teacher(input_ids, **packed(positions))
    chunk_loss = DistillationChunkLoss(kd)
    total = _OnWholeLogits.apply(model(input_ids, **packed(positions)), chunk_loss, labels.flatten(),
                                 teacher_logits.flatten(0, -2))
    return with_router_aux_loss(model, chunk_loss.losses(total, labelled_positions(labels)))


# ---- the losses of a model ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loss:
    """A loss both ways: on whole logits, and per chunk for `chunked_head_loss`; both average over the positions
    that have a label."""

    on_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_chunk: ChunkLoss


LOSSES = {"cross_entropy": Loss(cross_entropy, cross_entropy_chunk)}


def router_aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The mixture-of-experts routers' load-balancing loss of the model's latest forward, weighted by its coefficient
    (`GPT.router_aux_loss`), or None: a model without that method, without MoE layers, or with a coefficient of 0."""
    from litgpt.checkpoint.manager import unwrap

    method = getattr(unwrap(model), "router_aux_loss", None)
    return method() if callable(method) else None


def with_router_aux_loss(model: nn.Module, losses: Losses) -> Losses:
    """`losses` with the router's auxiliary loss, where the model has one, added to "loss" and reported as
    `aux_loss`; a loss that had no parts (the cross-entropy alone) becomes the part `ce_loss`."""
    aux = router_aux_loss(model)
    if aux is None:
        return losses
    parts = {name: value for name, value in losses.items() if name != "loss"} or {"ce_loss": losses["loss"].detach()}
    return {"loss": losses["loss"] + aux, **parts, "aux_loss": aux.detach()}


def model_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss: Loss,
               chunk_size: Optional[int] = None, positions: Optional[torch.Tensor] = None) -> Losses:
    """The mean of `loss` over the labelled positions of a `GPT` (or Fabric's wrapper of one), its logits built
    chunk by chunk (`chunked_head_loss`) from the final hidden states the model's forward returns. `positions`:
    packed samples (`litgpt.data.packing`); the mean is over every labelled token of the micro-batch either way."""
    from litgpt.checkpoint.manager import unwrap

    gpt = unwrap(model)
    hidden = model(input_ids, return_hidden=True, **packed(positions))
    total = head_loss(gpt, hidden, labels, loss.per_chunk, chunk_size)
    return with_router_aux_loss(model, {"loss": total / labelled_positions(labels)})


def loss_function(name: str, chunk_size: Optional[int] = None, chunked: bool = True) -> LossFunction:
    """loss(model, input_ids, labels, positions=None) -> Losses for the loss `name` of LOSSES: chunked
    (`model_loss`, `chunk_size` positions per chunk, None: automatic), or on the model's whole logits (a compiled
    module whose head is not callable from outside, extensions/thunder)."""
    loss = LOSSES[name]
    if not chunked:
        return lambda model, input_ids, labels, positions=None: with_router_aux_loss(
            model, {"loss": loss.on_logits(model(input_ids, **packed(positions)), labels)})
    return lambda model, input_ids, labels, positions=None: model_loss(
        model, input_ids, labels, loss, chunk_size, positions)


def distillation_loss_function(teacher: nn.Module, kd: KDArgs, chunk_size: Optional[int] = None,
                               chunked: bool = True) -> LossFunction:
    """loss(model, input_ids, labels, positions=None) -> Losses of distilling the frozen `teacher` into the model
    (`distillation_loss`, or `distillation_loss_on_logits` with `chunked=False`)."""
    if not chunked:
        return lambda model, input_ids, labels, positions=None: distillation_loss_on_logits(
            model, teacher, input_ids, labels, kd, positions)
    return lambda model, input_ids, labels, positions=None: distillation_loss(
        model, teacher, input_ids, labels, kd, chunk_size, positions)
