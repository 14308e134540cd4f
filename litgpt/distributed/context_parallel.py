"""Context parallelism, Ulysses' head scatter: each rank of a context-parallel group of N runs 1/N of every
sequence's positions (a contiguous slice) through the whole model, and each attention layer gathers every position of
1/N of its heads by an all-to-all, attends causally over the whole sequence, and sends the heads back by another.

Norms, MLPs, embeddings and the loss see only the rank's positions; rotary embeddings rotate by the positions of the
whole sequence (the model's `sample_positions`: each token's position within its sample). The loss's sums and its
count of labelled positions add up over the group (`ContextParallel.group_losses`), so every rank reports one
process's loss, and so do a mixture-of-experts layer's routing statistics (`summed_router_stats`: its load-balancing
loss is the whole sequence's, the padding that splits the sequence evenly left out of it). The model file knows
nothing of this: `apply_context_parallel` wraps each attention's `attend` and each MoE layer's statistics.

On CUDA (`--parallel.context_attention auto`) a layer of plain causal attention runs PyTorch's ring attention
instead (`ring_attention`: torch.distributed.tensor.experimental's context parallelism): each rank keeps its
positions' queries, the keys and values of the group come to it, and the partial softmaxes merge by their
log-sum-exp. The batch split and the loss are the same for both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from litgpt.data.base import IGNORE_INDEX
from litgpt.distributed.dtensor import summed_gradient
from litgpt.distributed.expert_parallel import AllToAllRows
from litgpt.distributed.plans.styles import local_views
from litgpt.model import CausalSelfAttention, MultiheadLatentAttention, attention_mask, numbered_blocks
from litgpt.moe import LLaMAMoE, RouterStats

Losses = dict[str, torch.Tensor]


class ContextParallel:
    """This rank's context-parallel group (the 1-D `mesh`) and the micro-batch it is running: the attention masks of
    its whole sequence (`mask_for`), which every attention layer of the run's models reads."""

    def __init__(self, mesh, tensor: int = 1, ring: bool = False) -> None:
        self.mesh, self.group = mesh, mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.tensor = tensor  # each rank's slice is split again by sequence parallelism: a multiple of it
        self.ring = ring  # plain causal attention runs PyTorch's ring attention (`ring_attention`)
        if ring:
            enable_ring_attention()
        self.moe_layers: list[LLaMAMoE] = []  # the run's models' MoE layers (`apply_context_parallel`)
        # The micro-batch's whole sequence: its length, its packed samples' positions (None: not packed), its device,
        # and the attention masks built for it, by sliding window (None: none).
        self.length, self.sample_positions, self.device = 0, None, torch.device("cpu")
        # The longest real position of each row of the micro-batch ((B, 1); (1, 1) where every row is alike).
        self.longest = torch.zeros(1, 1, dtype=torch.long)
        self.masks: dict[Optional[int], Optional[torch.Tensor]] = {}

    def local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor]):
        """This rank's slice of the micro-batch's (input_ids, labels, sample positions), padded at their end to a
        multiple of the group (x the tensor degree): causal attention keeps the padding out of every real position,
        and it has no labels. The positions are always given, so rotary embeddings rotate by whole-sequence ones."""
        B, T = input_ids.shape
        pad = -T % (self.size * self.tensor)
        self.length, self.device, self.masks = T + pad, input_ids.device, {}
        if positions is None:
            positions = torch.arange(T + pad, device=input_ids.device).expand(B, T + pad)
            self.sample_positions, self.longest = None, positions[:1, T - 1:T]
        else:
            self.longest = positions.amax(dim=-1, keepdim=True)
            steps = torch.arange(1, pad + 1, device=positions.device, dtype=positions.dtype)
            positions = torch.cat((positions, positions[:, -1:] + steps), dim=1)  # the padding joins the last sample
            self.sample_positions = positions
        input_ids, labels = F.pad(input_ids, (0, pad)), F.pad(labels, (0, pad), value=IGNORE_INDEX)
        local = slice(self.rank * (T + pad) // self.size, (self.rank + 1) * (T + pad) // self.size)
        counted = self.counted_positions(T)
        for layer in self.moe_layers:  # the routing statistics leave the padding out
            layer.counted_positions = counted
        return input_ids[:, local], labels[:, local], positions[:, local]

    def longest_position(self, positions: torch.Tensor) -> torch.Tensor:
        """`GPT.longest_position` of this rank's slice `positions` (B, T): the whole sequence's, padding left out."""
        return self.longest.expand(positions.size(0), 1)

    def mask_for(self, window: Optional[int]) -> Optional[torch.Tensor]:
        """The attention mask of the micro-batch's whole sequence for layers of sliding `window` (None: every earlier
        position), packed samples kept apart; None for plain causal attention. Built once per micro-batch."""
        if window not in self.masks:
            self.masks[window] = attention_mask(self.length, self.length, None, window, self.device,
                                                self.sample_positions)
        return self.masks[window]

    def counted_positions(self, length: int, padded: Optional[int] = None) -> Optional[int]:
        """How many of this rank's positions are real ones, of sequences of `length` padded at their end to `padded`
        (default: a multiple of the group x the tensor degree) and split over the group; None where all are."""
        padded = padded or length + -length % (self.size * self.tensor)
        per_rank = padded // self.size
        counted = min(max(length - self.rank * per_rank, 0), per_rank)
        return None if counted == per_rank else counted

    def group_losses(self, losses: Losses, labels: torch.Tensor) -> Losses:
        """The group's losses from this rank's: each a mean over its labelled positions becomes a sum, the sums and
        counts are added over the group, and the means are taken again. The sum is differentiable: its gradient
        reaches this rank's part from every rank's copy of the loss (N times one process's), which FSDP's average
        over data x context ranks divides by N again."""
        labelled = (labels != IGNORE_INDEX).sum()
        names = list(losses)
        sums = torch.stack([losses[name].float() * labelled for name in names] + [labelled.float()])
        sums = SumOverGroup.apply(sums, self.group)
        means = sums[:-1] / sums[-1].clamp(min=1)
        return {name: means[index] if name == "loss" else means[index].detach() for index, name in enumerate(names)}


class SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over the group on every rank; its gradient is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def apply_context_parallel(model: nn.Module, context: ContextParallel) -> None:
    """Every attention layer of `model` (a `GPT`) attends over the whole sequence of its share of heads; every
    mixture-of-experts layer records its routing over the whole sequence (`summed_router_stats`); rotary embeddings
    choose LongRoPE's factors by the whole sequence's longest position."""
    config = model.config
    gpt = getattr(model, "gpt", model)  # a pipeline stage builds its rotary tables with its whole GPT's
    gpt.longest_position = context.longest_position
    for index, block in numbered_blocks(model.transformer.h):
        if not isinstance(block.attn, (CausalSelfAttention, MultiheadLatentAttention)):
            raise RuntimeError(f"Context parallelism covers fused-qkv and latent attention, not "
                               f"{type(block.attn).__name__}.")
        window = config.sliding_window_size if config.is_sliding_layer(index) else None
        # Latent attention exchanges its latents, not every head's keys and values expanded from them.
        latent = isinstance(block.attn, MultiheadLatentAttention) and type(block.attn.kv_b_proj) is nn.Linear
        if latent:
            block.attn.expand = heads_from_gathered_latents(block.attn, context)
        block.attn.attend = head_scattered(block.attn, context, window, keys_by_heads=latent)
        plain = (isinstance(block.attn, CausalSelfAttention) and window is None and not config.attention_sinks
                 and config.attention_logit_softcapping is None)
        if context.ring and plain:
            block.attn.attend = ring_attention(block.attn, context, block.attn.attend)
        if isinstance(block.mlp, LLaMAMoE):
            block.mlp._router_stats = summed_router_stats(block.mlp._router_stats, context)
            context.moe_layers.append(block.mlp)


def summed_router_stats(router_stats: Callable[..., RouterStats], context: ContextParallel) -> Callable:
    """A MoE layer's `_router_stats` summed over the group: every rank's layer then holds the whole sequence's
    assignments, probability sums (their gradient reaching every rank's router) and token count, as one process's."""

    def over_the_group(*args) -> RouterStats:
        stats = router_stats(*args)
        counts = torch.cat((stats.counts.float(), stats.counts.new_tensor([stats.rows], dtype=torch.float32)))
        dist.all_reduce(counts, group=context.group)
        return RouterStats(counts[:-1], SumOverGroup.apply(stats.prob_sum, context.group), counts[-1])

    return over_the_group


def head_scattered(attention: nn.Module, context: ContextParallel, window: Optional[int],
                   keys_by_heads: bool = False) -> Callable:
    """`attention.attend(q, k, v, mask)` on (B, heads, local positions, head_size) run on every position of 1/N of
    the heads. Heads are dealt in contiguous runs, so each rank's query heads share its key-value groups, and its
    attention sinks are those heads' (the rest of the sinks' gradient comes from the other ranks). With
    `keys_by_heads` the keys and values come as the rank's run of heads over the whole sequence already (latent
    attention's, `heads_from_gathered_latents`): only the queries travel. The mask the model built for the local slice
    is replaced by the whole sequence's (`ContextParallel.mask_for` the layer's sliding `window`)."""
    attend = attention.attend

    def attend_whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        if q.size(-2) * (context.size if keys_by_heads else 1) != k.size(-2):
            raise RuntimeError("Context parallelism runs training and scoring passes, not decoding with a KV cache.")
        q = positions_to_heads(q, context)
        if not keys_by_heads:
            k, v = positions_to_heads(k, context), positions_to_heads(v, context)
        heads = q.size(1)
        run = slice(context.rank * heads, (context.rank + 1) * heads)
        sinks = [(attention, "sinks", lambda sinks: sinks[run])] if attention.config.attention_sinks else []
        with local_views(sinks):
            y = attend(q, k, v, context.mask_for(window))
        return heads_to_positions(y, context)

    return attend_whole_sequence


def ring_attention(attention: CausalSelfAttention, context: ContextParallel, packed: Callable) -> Callable:
    """`attention.attend(q, k, v, mask)` of plain causal attention on (B, heads, local positions, head_size) as
    PyTorch's ring attention over the group: q, k and v become DTensors split along the positions, and the fused
    kernel's op (flash in 16 bits, memory-efficient in float32 on CUDA) runs through the context-parallel dispatcher
    (`enable_ring_attention`), which computes this rank's queries against every rank's keys, causally, forward and
    backward. Packed samples need their mask: `packed` (the head scatter) runs those batches."""
    aten = torch.ops.aten
    repeats = attention.n_head // attention.n_query_groups

    def attend_around_the_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        if context.sample_positions is not None:
            return packed(q, k, v, mask)
        if q.size(-2) != k.size(-2):
            raise RuntimeError("Context parallelism runs training and scoring passes, not decoding with a KV cache.")
        if repeats > 1:  # the kernels take as many key-value heads as query heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q, k, v = (DTensor.from_local(x.contiguous(), context.mesh, [Shard(2)], run_check=False) for x in (q, k, v))
        if q.is_cuda and q.dtype == torch.float32:  # flash attention takes 16-bit inputs only
            y = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=attention.scale)
        else:
            y = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=attention.scale)
        return y[0].to_local()

    # Compiled blocks run it eager (a graph break): DTensors through the dispatcher's custom handlers, as PyTorch
    # runs its ring attention, not traced.
    return torch.compiler.disable(attend_around_the_ring)


def enable_ring_attention() -> None:
    """PyTorch's context-parallel dispatcher for DTensors (its ring attention for the fused attention ops), for the
    whole process: the backward passes run after any forward's scope. The ranks hold contiguous slices
    (`ContextParallel.local_batch`), not PyTorch's load-balanced chunks: causal attention then skips the keys of
    later ranks."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention._cp_options.enable_load_balance = False
    _attention._enable_cp_dtensor_dispatcher()


def heads_from_gathered_latents(attention: MultiheadLatentAttention, context: ContextParallel) -> Callable:
    """`attention.expand(latent, k_rope)` for this rank's run of 1/N of the heads over the whole sequence: the
    latents (B, 1, local positions, kv_lora_rank) and the shared rotary keys are gathered from every rank of the group
    (kv_lora_rank + qk_rope_head_dim elements a position, where every head's expanded key and value take n_head x
    (head_size + v_head_dim)), and kv_b_proj's rows of the rank's heads expand them. The gathers' gradients return
    each rank's share, summed over the group; under tensor parallelism (kv_b_proj a DTensor of the tensor-parallel
    rank's heads) the latent's and the rotary key's are summed over the tensor-parallel ranks too, as its plan's
    column split and `SummedGradientOf` sum them."""
    c = attention.config

    def expand_my_heads(latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = attention.kv_b_proj.weight
        if isinstance(weight, DTensor):
            latent, k_rope = (summed_gradient(x, weight.device_mesh) for x in (latent, k_rope))
            weight = weight.to_local()
        latent, k_rope = gather_positions(latent, context), gather_positions(k_rope, context)
        heads = attention.n_head // context.size
        rows = weight.view(attention.n_head, -1, c.kv_lora_rank)[context.rank * heads:(context.rank + 1) * heads]
        B, _, S, _ = latent.shape
        kv = F.linear(latent, rows.flatten(0, 1)).view(B, S, heads, -1).transpose(1, 2)
        k_nope, v = kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)
        return torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1), v

    return expand_my_heads


def gather_positions(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """(B, 1, T/N, n) of this rank's positions -> (B, 1, T, n) of every rank's, differentiable (an all-to-all of N
    copies: its backward sums every rank's gradient of this rank's positions)."""
    received = all_to_all(x.unsqueeze(0).expand(context.size, *x.shape), context)  # row j: rank j's positions
    return received.movedim(0, 2).flatten(2, 3)


def positions_to_heads(x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """(B, H, T/N, hs) of this rank's positions -> (B, H/N, T, hs) of its heads: rank j gets the j-th run of heads."""
    n = context.size
    sent = x.unflatten(1, (n, x.size(1) // n)).movedim(1, 0)  # (N, B, H/N, T/N, hs): row j goes to rank j
    received = all_to_all(sent, context)  # row j: rank j's positions
    return received.movedim(0, 2).flatten(2, 3)


def heads_to_positions(y: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """(B, H/N, T, hs) of this rank's heads -> (B, H, T/N, hs) of its positions, the inverse of `positions_to_heads`."""
    n = context.size
    sent = y.unflatten(2, (n, y.size(2) // n)).movedim(2, 0)  # (N, B, H/N, T/N, hs): row j goes to rank j
    received = all_to_all(sent, context)  # row j: heads run j
    return received.movedim(0, 1).flatten(1, 2)


def all_to_all(rows: torch.Tensor, context: ContextParallel) -> torch.Tensor:
    """Row j of `rows` (N, ...) to rank j of the group; row j of the result from rank j; differentiable."""
    splits = [1] * context.size
    return AllToAllRows.apply(rows, splits, splits, context.group)
