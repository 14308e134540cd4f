"""Sparse mixture-of-experts layers: the router, the routing of tokens to experts, and the grouped kernels that run
every expert's linear layer as one multiplication (with LoRA adapters on the experts, `AdaptedLinear`)."""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from litgpt.config import Config
from litgpt.mlp import LLaMAMLP, swiglu
from litgpt.nf4 import is_nf4
from litgpt.precision import compute_dtype


@runtime_checkable
class AdaptedLinear(Protocol):
    """What the experts' kernels read from an expert linear layer with one low-rank update over all of its rows,
    y = x W^T + b + (lora_dropout(x) lora_A^T lora_B^T) * scaling (`litgpt.lora.LoRALinear` with a single part)."""

    r: int  # the rank of the update: the columns of lora_B
    scaling: float  # the update's factor, alpha / r
    applies_update: bool  # False once the update is merged into the weight or while it is switched off
    lora_A: torch.Tensor  # (r, in_features)
    lora_B: torch.Tensor  # (out_features, r)
    lora_dropout: nn.Module  # applied to the input of the update only


class ExpertDispatch(Protocol):
    """Where a MoE layer's expert rows are computed when its experts are not all its own (expert parallelism, set
    from outside: `litgpt.distributed.expert_parallel`): `dispatch(rows, counts, run_local)` takes the rows sorted by
    expert (`counts[e]` of them, int64, for each of the layer's n_expert experts), has them computed where their
    experts live by `run_local(rows, experts)` (the layer's own experts on rows, row i to `self.experts[experts[i]]`)
    and returns their outputs in the same order."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor,
                 run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


class LLaMAMoE(nn.Module):
    """Sparse mixture of SwiGLU experts: each token goes to its top-k experts, weighted by the router (`route`:
    Mixtral's softmax, or DeepSeek-V3's sigmoid with a correction bias and group-limited choice), plus, with
    moe_n_shared_expert, the shared experts' MLP that every token goes through.

    The (token, slot) pairs are sorted by expert so that each expert's rows are contiguous, and every expert linear
    layer runs as one grouped matrix multiplication over all experts (`_ExpertsLinear`). Shapes never depend on the
    routing and nothing is read back to the host, so the forward pass does not wait for the device and
    `torch.compile` sees static shapes (quantized experts excepted: they run as modules, after one read of the counts
    per layer); biased experts add each row's expert's bias. The parameters stay one `LLaMAMLP` per expert and `gate`
    a `Router` (an `nn.Linear`) whose output is the router logits: the state-dict layout of checkpoints, conversion
    and LoRA is unchanged.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            LLaMAMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_expert)
        )
        # DeepSeek's shared experts: one MLP every token goes through, added to the routed experts' output.
        self.shared_experts = (
            LLaMAMLP(config, intermediate_size=config.moe_shared_intermediate_size)
            if config.moe_n_shared_expert else None
        )
        self.config = config
        # What the load-balancing loss needs from the latest forward pass (`GPT.router_aux_loss`).
        self.router_stats: Optional[RouterStats] = None
        # None: `self.experts` are all of the layer's experts, computed here.
        self.dispatch: Optional[ExpertDispatch] = None
        # The first positions of each sequence that the load-balancing statistics count (None: all of them); the
        # rest is padding added from outside (tensor parallelism pads the sequences to a multiple of its degree).
        self.counted_positions: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        k = self.config.n_expert_per_token
        x = x.reshape(-1, C)
        weights, chosen, scores = self.route(x)
        dtype = compute_dtype(x)
        route = Routing.sort(chosen, self.config.n_expert, self._kernel(x, dtype))
        if self.config.router_aux_loss_coef:
            # Computed in every run of the block, so that a recomputation saves what the first forward saved.
            probabilities = self.probabilities(scores)
            if self.router_stats is None:
                # GPT.forward clears this; recording only once keeps the first forward's tensors (those in the
                # loss' graph) when activation checkpointing runs the block again in the backward pass.
                self.router_stats = self._router_stats(route, chosen, probabilities, B, T)
        rows = x.index_select(0, route.token)
        if self.dispatch is None:
            y = self._sorted_rows(rows, route, dtype)
        else:
            y = self.dispatch(rows, route.counts().long(), self.local_experts)
        # Back to (token, slot) order; every token has exactly k slots, so the weighted sum is a reshape.
        y = y.index_select(0, route.inverse).view(-1, k, C)
        y = (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1, dtype=x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(B, T, C)

    def _router_stats(self, route: "Routing", chosen: torch.Tensor, probabilities: torch.Tensor, B: int,
                      T: int) -> "RouterStats":
        """The routing's statistics over the counted positions of each sequence (`counted_positions`)."""
        counted = self.counted_positions
        if counted is None or counted == T:
            return RouterStats(route.counts(), probabilities.sum(dim=0), B * T)
        chosen = chosen.view(B, T, -1)[:, :counted]
        counts = torch.bincount(chosen.flatten(), minlength=self.config.n_expert).float()
        return RouterStats(counts, probabilities.view(B, T, -1)[:, :counted].sum(dim=(0, 1)), B * counted)

    def local_experts(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This layer's own experts (`self.experts`) on `rows`, row i going to `self.experts[experts[i]]`: the
        outputs in the rows' order (what an `ExpertDispatch` runs on the rows it brought here)."""
        dtype = compute_dtype(rows)
        route = Routing.sort(experts.unsqueeze(1), len(self.experts), self._kernel(rows, dtype))
        y = self._sorted_rows(rows.index_select(0, route.token), route, dtype)
        return y.index_select(0, route.inverse)

    def _sorted_rows(self, rows: torch.Tensor, route: "Routing", dtype: torch.dtype) -> torch.Tensor:
        """The experts on rows sorted by expert (`route`), in the kernel `route` names."""
        if route.kernel == "modules":
            return self._expert_modules(rows, route)
        if dtype == rows.dtype:
            return route.from_layout(self._experts(route.to_layout(rows), route))
        # autocast: the experts run in its dtype, cast here once (it does not know torch._grouped_mm)
        with torch.autocast(rows.device.type, enabled=False):
            return route.from_layout(self._experts(route.to_layout(rows.to(dtype)), route))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, experts), each (tokens, n_expert_per_token), and the scores of every expert (tokens, n_expert),
        all float32.

        Softmax routers (Mixtral, Qwen3-MoE, DeepSeek-V2) weight the chosen experts by their probabilities; sigmoid
        routers (DeepSeek-V3, GLM-4.5) by their scores, each expert's on its own. The correction bias and the group
        limit change only which experts are chosen, never their weights; the weights are then renormalized
        (moe_renormalize) and scaled (moe_routed_scaling), as transformers' DeepseekV3 does.
        """
        return self.route_logits(self.gate(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`route` from the router's logits (tokens, n_expert), as `litgpt compress_moe` reads them."""
        c = self.config
        if c.moe_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        with torch.no_grad():  # which experts: no gradient flows through the choice, autograd keeps none of it
            bias = self.gate.e_score_correction_bias
            choice = scores if bias is None else scores + bias
            if c.moe_n_group > 1:
                choice = self._limit_to_groups(choice)
            chosen = choice.topk(c.n_expert_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        if c.moe_renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if c.moe_routed_scaling != 1.0:
            weights = weights * c.moe_routed_scaling
        return weights, chosen, scores

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """The router's distribution over the experts that the load-balancing loss reads: the softmax itself, or
        each token's sigmoid scores divided by their sum (so that P_e sums to one, as in Switch Transformer's loss)."""
        if self.config.moe_score_function == "softmax":
            return scores
        return scores / scores.sum(dim=-1, keepdim=True)

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The scores of the experts outside each token's moe_topk_group best groups set to -inf."""
        c = self.config
        grouped = choice.view(-1, c.moe_n_group, c.n_expert // c.moe_n_group)
        if c.moe_group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(c.moe_topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def _kernel(self, x: torch.Tensor, dtype: torch.dtype) -> str:
        """How the experts run, decided once per forward pass: "grouped" (torch._grouped_mm), "blocks" (one bmm over
        blocks of rows padded per expert, where the device or dtype has no grouped kernel) or "modules" (each expert
        module on its own rows, for quantized linear layers, which only run as modules)."""
        first = self.experts[0]
        linears = (first.fc_1, first.fc_2, first.proj)
        if any(not _plain_weight(linear.weight) for linear in linears):
            return "modules"
        sizes = [self.config.n_embd, first.fc_1.out_features]  # the experts' width as their layers hold it
        if _lora(first.fc_1):
            sizes.append(first.fc_1.r)  # the adapters' rows of r elements
        return "grouped" if _grouped_mm_supported(x.device, dtype, sizes) else "blocks"

    def _experts(self, x: torch.Tensor, route: "Routing") -> torch.Tensor:
        """The SwiGLU experts on the rows of `x` laid out by expert; fc_1 and fc_2 run as one multiplication."""
        gate, up = self._linear(x, route, "fc_1", "fc_2")
        return self._linear(swiglu(self.config, gate, up), route, "proj")[0]

    def _expert_modules(self, x: torch.Tensor, route: "Routing") -> torch.Tensor:
        # The one host read of this layer: a module takes a tensor of its own rows, whose size the host must know.
        chunks = x.split(route.counts().long().tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])

    def _linear(self, x: torch.Tensor, route: "Routing", *names: str) -> list[torch.Tensor]:
        """Every expert's linear layer `name` (several names: their outputs side by side in one multiplication)."""
        layers = [[getattr(expert, name) for expert in self.experts] for name in names]
        weights = [layer.weight.to(x.dtype) for per_expert in zip(*layers) for layer in per_expert]
        out = _ExpertsLinear.apply(x, route.groups, route.kernel, len(names), *weights)
        outs = list(out.split([per_name[0].out_features for per_name in layers], dim=-1))
        for i, per_name in enumerate(layers):
            if _lora(per_name[0]):
                outs[i] = outs[i] + self._lora_update(x, route, per_name)
            if per_name[0].bias is not None:  # each row gets its own expert's bias
                bias = torch.stack([layer.bias for layer in per_name]).to(x.dtype)
                outs[i] = outs[i] + bias.index_select(0, route.experts)
        return outs

    @staticmethod
    def _lora_update(x: torch.Tensor, route: "Routing", layers: list[AdaptedLinear]) -> torch.Tensor:
        """LoRA's scaling * dropout(x) A^T B^T with each row's own expert's factors (`AdaptedLinear` layers)."""
        first = layers[0]
        a = [layer.lora_A.to(x.dtype) for layer in layers]
        b = [layer.lora_B.to(x.dtype) for layer in layers]
        low = _ExpertsLinear.apply(first.lora_dropout(x), route.groups, route.kernel, 1, *a) * first.scaling
        return _ExpertsLinear.apply(low, route.groups, route.kernel, 1, *b)


class Router(nn.Linear):
    """A mixture of experts' router: `weight` (n_expert, n_embd) gives the logits, in float32 for sigmoid routers as
    DeepSeek-V3 and GLM-4.5 compute them (their checkpoints keep the router in float32), in the model's dtype for
    softmax ones (Mixtral). `e_score_correction_bias` (n_expert,), with moe_expert_bias, is the buffer DeepSeek-V3
    adds to the scores to choose the experts; load balancing adjusts it outside of gradient descent, so it is a
    buffer, saved, loaded and converted with the weights, never trained."""

    def __init__(self, config: Config) -> None:
        super().__init__(config.n_embd, config.n_expert, bias=config.router_bias)
        self.float32_logits = config.moe_score_function == "sigmoid"
        self.e_score_correction_bias: Optional[torch.Tensor]
        if config.moe_expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_expert))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse: bool = True):
        """`Module.to(dtype)` (and .half(), .bfloat16()) casts the weight but keeps the correction bias in float32,
        as transformers and the published checkpoints do: the choice among experts turns on differences of a few
        thousandths, below bfloat16's resolution of the scores."""
        before = self.e_score_correction_bias
        super()._apply(fn, recurse)
        after = self.e_score_correction_bias
        if before is not None and before.dtype == torch.float32 and after.dtype != torch.float32:
            self.e_score_correction_bias = after.float() if before.is_meta != after.is_meta else before.to(after.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.float32_logits:
            return super().forward(x)
        autocast_off = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else None
        with autocast_off or contextlib.nullcontext():
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class RouterStats(NamedTuple):
    """One MoE layer's routing in one forward pass (or several layers' summed): top-k assignments per expert (float,
    no gradient), the router probabilities summed over the tokens per expert (in the autograd graph), and the number
    of tokens."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    rows: Union[int, torch.Tensor]


def load_balancing_loss(config: Config, stats: Sequence[RouterStats]) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as Mixtral and Qwen3-MoE define it (transformers'
    `load_balancing_loss_func`), times `config.router_aux_loss_coef`: n_expert * sum_e f_e * P_e, where f_e is the
    fraction of top-k assignments that went to expert e and P_e the mean router probability of e, both taken over
    every token of every layer of `stats` together."""
    rows = sum(s.rows for s in stats)
    fraction = torch.stack([s.counts for s in stats]).sum(dim=0) / rows
    probability = torch.stack([s.prob_sum for s in stats]).sum(dim=0) / rows
    return config.router_aux_loss_coef * config.n_expert * (fraction * probability).sum()


class Routing:
    """Where each (token, slot) pair goes, computed on the device from the chosen experts alone.

    `token[i]` is the token of the i-th row sorted by expert (a stable sort, so each expert's rows stay in token
    order), `ends[e]` the end of expert e's rows, `inverse` the sorted row of each (token, slot) pair and `experts`
    the expert of each of the kernel's rows. `groups` tells the kernel which rows are whose: the int32 `ends` for
    "grouped", the expert of each block for "blocks".
    """

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.block_size = 0
        self.padded_rows: Optional[torch.Tensor] = None  # "blocks": each sorted row's place among the padded rows

    @classmethod
    def sort(cls, chosen: torch.Tensor, n_expert: int, kernel: str) -> "Routing":
        route = cls(kernel)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        sorted_experts = flat.index_select(0, order)
        route.token = order.div(chosen.size(1), rounding_mode="floor")
        route.ends = torch.searchsorted(sorted_experts, torch.arange(n_expert, device=flat.device), right=True)
        route.inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        route.groups = route.ends.to(torch.int32)
        route.experts = sorted_experts
        if kernel == "blocks":
            route._pad_to_blocks(sorted_experts)
        return route

    def counts(self) -> torch.Tensor:
        """Rows per expert, as float."""
        return torch.diff(self.ends, prepend=self.ends.new_zeros(1)).float()

    def _pad_to_blocks(self, sorted_experts: torch.Tensor) -> None:
        """Give each expert whole blocks of `block_size` rows (zero rows fill its last one), so that every block
        belongs to one expert and all experts run as one bmm. The number of blocks is the bound over all routings,
        (rows + n_expert * (block_size - 1)) / block_size, so shapes stay static; a block size of at least the mean
        rows per expert keeps it at most about twice the number of experts."""
        n_expert, rows = self.ends.numel(), sorted_experts.numel()
        size = self.block_size = max(16, 1 << (max(1, -(-rows // n_expert)) - 1).bit_length())
        counts = self.counts().long()
        padded_counts = (counts + size - 1) // size * size
        padded_ends = padded_counts.cumsum(0)
        shift = (padded_ends - padded_counts) - (self.ends - counts)  # padded start - sorted start, per expert
        self.padded_rows = torch.arange(rows, device=sorted_experts.device) + shift.index_select(0, sorted_experts)
        starts = torch.arange(-(-(rows + n_expert * (size - 1)) // size), device=sorted_experts.device) * size
        self.groups = torch.searchsorted(padded_ends, starts, right=True).clamp_(max=n_expert - 1)
        self.experts = self.groups.repeat_interleave(size)  # the expert of each padded row

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert -> the kernel's rows (zero-padded blocks for "blocks")."""
        if self.kernel != "blocks":
            return x
        return x.new_zeros(self.groups.numel() * self.block_size, x.size(1)).index_copy(0, self.padded_rows, x)

    def from_layout(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.kernel != "blocks" else y.index_select(0, self.padded_rows)


class _ExpertsLinear(torch.autograd.Function):
    """x @ W_e^T for the rows of each expert e, W_e being the expert's `n_parts` weights (out, in) stacked along
    their rows. The experts' weights are stacked for the multiplication in the forward pass and again in the backward
    pass: autograd would otherwise save the stacked copy, one more copy of every expert's weights per layer kept
    until the backward pass, where this saves only the parameters themselves (alive anyway; under FSDP2 the block's
    unsharded ones, gathered again for the backward pass) and the small routing tensors. Measured on the layer of
    benchmarks/moe.py (64 experts, 4096 tokens, float32): 370 MiB kept instead of 562; the price is a second copy
    of the weights in the backward pass (8% of the layer's step on the CPU)."""

    @staticmethod
    def forward(ctx, x, groups, kernel: str, n_parts: int, *weights):
        ctx.save_for_backward(x, groups, *weights)
        ctx.kernel, ctx.n_parts = kernel, n_parts
        return _experts_mm(x, _stack(weights, n_parts).transpose(1, 2), groups, kernel)

    @staticmethod
    def backward(ctx, grad):
        x, groups, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # an expanded gradient (stride 0) is no valid operand of a grouped matmul
        stacked = _stack(weights, ctx.n_parts)
        grad_x = _experts_mm(grad, stacked, groups, ctx.kernel) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[4:]):
            grad_stacked = _experts_weight_grad(grad, x, groups, ctx.kernel, stacked.size(0))
            sizes = [w.size(0) for w in weights[: ctx.n_parts]]
            grad_weights = [part for expert in grad_stacked for part in expert.split(sizes)]
        return grad_x, None, None, None, *grad_weights


def _stack(weights, n_parts: int) -> torch.Tensor:
    """(n_expert, sum of the parts' rows, in) from the experts' weights listed expert by expert, in one copy."""
    if all(w.shape == weights[0].shape for w in weights[:n_parts]):
        stacked = torch.stack(weights)
        return stacked.view(-1, n_parts * stacked.size(1), stacked.size(2))
    return torch.stack([torch.cat(weights[i : i + n_parts]) for i in range(0, len(weights), n_parts)])


def _experts_mm(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, kernel: str) -> torch.Tensor:
    """x (rows, in) @ w[e] (in, out) for each expert's rows."""
    if kernel == "grouped":
        return _grouped_mm(x, w, groups)
    blocks = x.view(groups.numel(), -1, x.size(1))
    return torch.bmm(blocks, w.index_select(0, groups)).view(x.size(0), w.size(2))


def _experts_weight_grad(grad, x, groups, kernel: str, n_expert: int) -> torch.Tensor:
    """sum over each expert's rows of grad^T x: (n_expert, out, in)."""
    if kernel == "grouped":
        return _grouped_mm(grad.t(), x, groups)
    n_blocks = groups.numel()
    per_block = torch.bmm(grad.view(n_blocks, -1, grad.size(1)).transpose(1, 2), x.view(n_blocks, -1, x.size(1)))
    return per_block.new_zeros(n_expert, *per_block.shape[1:]).index_add_(0, groups, per_block)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs): (rows, in) x (groups, in, out) -> (rows, out), or (out, rows) x (rows, in)
    -> (groups, out, in). torch's meta kernel (fake tensors, torch.compile) takes bf16 alone where its CPU kernel
    also runs 16- and 32-bit floats: those go through an op of our own that knows the shapes."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_op(a, b, offs)


@torch.library.custom_op("litgpt::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.size(0), b.size(2))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _plain_weight(weight: Optional[torch.Tensor]) -> bool:
    """A weight the grouped kernels can read: floating point and not quantized (bitsandbytes keeps integers, or no
    `weight` under LoRA; torchao's NF4 is a tensor subclass that only runs as F.linear)."""
    return weight is not None and weight.is_floating_point() and not is_nf4(weight)


def _lora(linear: nn.Module) -> bool:
    """Whether an expert linear layer applies LoRA factors (`litgpt.lora.LoRALinear`, neither merged into its weight
    nor switched off)."""
    return isinstance(linear, AdaptedLinear) and linear.applies_update


def _grouped_mm_supported(device: torch.device, dtype: torch.dtype, sizes: list[int]) -> bool:
    """Whether torch._grouped_mm runs these matrices without a host sync: on the CPU for 16- and 32-bit floats, on
    CUDA through its CUTLASS kernel, bf16 on sm90/sm100 (elsewhere it falls back to a loop that reads the group ends
    back to the host). Every row it reads must start on a 16-byte boundary."""
    if device.type == "cpu":
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    elif device.type == "cuda" and torch.cuda.is_available():
        dtypes = (torch.bfloat16,) if torch.cuda.get_device_capability(device)[0] in (9, 10) else ()
    else:
        dtypes = ()
    return dtype in dtypes and all(size * dtype.itemsize % 16 == 0 for size in sizes)


