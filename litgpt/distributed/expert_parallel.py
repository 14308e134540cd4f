"""Expert parallelism (`--parallel.expert N`) of a model built on the meta device: each rank of an expert group keeps
n_expert / N whole experts of every MoE layer (`LocalExperts`, under their one-process names), and the layer's rows
travel to their experts' owners by all-to-all and back (`AllToAllDispatch`, the layer's `litgpt.moe.ExpertDispatch`).
The router, its auxiliary loss (each rank routes its own tokens over all experts, as one process does) and DeepSeek's
shared experts stay with data parallelism (`litgpt.distributed.plans.experts`).

Checkpoints keep the one-process layout: `expert_peers` names the same expert slot on every rank of the group, so
full weights and optimizer states are gathered from the group (`gather_across_experts`) and a full checkpoint is
read into this rank's experts alone (`held_elsewhere` names the keys other ranks hold). A sharded checkpoint needs no
gathering: each expert's weights are DTensors of its one-process shape under its one-process name, on the ranks that
hold it, so torch.distributed.checkpoint reshards them to any mesh (`one_process_param_groups` lists every expert in
the optimizer's groups).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from litgpt.distributed.dtensor import clip_to_norm
from litgpt.distributed.pipeline import held_by_other_stages
from litgpt.distributed.plans import check_expert_parallel
from litgpt.distributed.runtime import print_once
from litgpt.distributed.plans.experts import MOE_LAYER, SPLIT
from litgpt.distributed.plans.styles import TensorParallelExperts
from litgpt.model import numbered_blocks
from litgpt.moe import LLaMAMoE


class LocalExperts(nn.ModuleList):
    """This rank's experts of one MoE layer, registered under their one-process indices (`experts.{first + j}`) and
    iterated and indexed by their place among this rank's (what `LLaMAMoE` reads). `whole` (not registered) lists
    every expert of the layer, the others left on the meta device: initialization draws what one process draws from
    them, and checkpoints read their names and shapes."""

    def __init__(self, whole: nn.ModuleList, first: int, count: int) -> None:
        super().__init__()
        for index in range(first, first + count):
            self.add_module(str(index), whole[index])
        self.first = first
        self.whole = list(whole)  # a plain list: the modules of other ranks stay out of this module's tree

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]

    def forward(self, run: Callable, *args):
        """`run(*args)`, called through the module so that FSDP gathers the experts' shards around it."""
        return run(*args)


class AllToAllDispatch:
    """A MoE layer's rows, sorted by expert, sent to the ranks of the expert group that own their experts (rank r
    owns experts r * n_local ... (r + 1) * n_local - 1), computed there by `run_local` (through `experts`, the layer's
    `LocalExperts`) and sent back in the same order. The one read to the host: the rows each rank sends and gets.

    The experts' gradients sum the tokens of the whole expert group, and FSDP averages them only over the ranks
    holding the same experts: they are divided by the group's size (the gradient of the experts' output, multiplied
    back at their input) to be the data-parallel mean every other parameter gets. (FSDP's own divide factor would
    need a premultiplied sum, which gloo lacks.)

    Under tensor parallelism too (`tensor_parallel`: the layer's experts also split along their width), every rank
    of a tensor-parallel group routes the same rows and exchanges them with the ranks of its expert group that share
    its tensor rank; each computes its share of its experts' width (`TensorParallelExperts.run`) and sends back
    partial sums, which the layer's output style sums over the tensor-parallel group."""

    def __init__(self, experts: LocalExperts, group, degree: int,
                 tensor_parallel: Optional[TensorParallelExperts] = None) -> None:
        self.experts, self.group, self.degree = experts, group, degree
        self.tensor_parallel = tensor_parallel

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run_local: Callable) -> torch.Tensor:
        n_local = counts.numel() // self.degree
        incoming = torch.empty_like(counts)  # from each rank of the group, its rows for each of my experts
        dist.all_to_all_single(incoming, counts, group=self.group)
        per_rank = torch.stack((counts.view(self.degree, n_local).sum(1), incoming.view(self.degree, n_local).sum(1)))
        send, receive = per_rank.tolist()
        received = AllToAllRows.apply(rows, receive, send, self.group)
        # Received by (source rank, my expert); `local_experts` sorts them by expert.
        local = torch.arange(n_local, device=rows.device).repeat(self.degree).repeat_interleave(incoming)
        received = _ScaleGradient.apply(received, float(self.degree))
        if self.tensor_parallel is None:
            out = self.experts(run_local, received, local)
        else:
            out = self.experts(self.tensor_parallel.run, received, local, run_local)
        return AllToAllRows.apply(_ScaleGradient.apply(out, 1.0 / self.degree), send, receive, self.group)


class _ScaleGradient(torch.autograd.Function):
    """The identity, its gradient multiplied by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class AllToAllRows(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; its gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def moe_layers(model: nn.Module) -> Iterator[tuple[str, LLaMAMoE]]:
    """(name, layer) of the blocks' MoE layers, as the plan names them (none in a model without blocks)."""
    transformer = getattr(model, "transformer", None)
    if transformer is None:
        return
    for index, block in numbered_blocks(transformer.h):
        layer = getattr(block, MOE_LAYER, None)
        if isinstance(layer, LLaMAMoE):
            yield f"transformer.h.{index}.{MOE_LAYER}", layer


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Keep this rank's experts of every MoE layer of `model` (a `GPT` on the meta device) and route the layers'
    rows over the 1-D `mesh` of its expert group, in place."""
    degree, rank = mesh.size(), mesh.get_local_rank()
    layers = list(moe_layers(model))
    if not layers:  # a dense frozen model (a teacher) stays whole on every rank
        return
    check_expert_parallel(model.config, degree)
    for _, layer in layers:
        whole = getattr(layer, SPLIT)
        count = len(whole) // degree
        local = LocalExperts(whole, rank * count, count)
        setattr(layer, SPLIT, local)
        # Under tensor parallelism (applied first) the layer's experts are split along their width: kept so, over
        # this rank's experts.
        tensor_parallel = layer.dispatch if isinstance(layer.dispatch, TensorParallelExperts) else None
        layer.dispatch = AllToAllDispatch(local, mesh.get_group(), degree,
                                          tensor_parallel and tensor_parallel.restricted_to(local))
    n_expert = model.config.n_expert
    width = ", each split along its width by tensor parallelism" if tensor_parallel is not None else ""
    print_once(f"Expert parallelism: each of {degree} devices holds {n_expert // degree} of the {n_expert} experts "
               f"of each of {len(layers)} MoE layers{width}.")


@contextlib.contextmanager
def whole_experts(model: nn.Module):
    """Every MoE layer listing all of its experts (the others' on the meta device) while inside: initialization
    visits the modules in one process's order (`litgpt.distributed.dtensor.FullTensorInit` draws and drops the
    others' weights)."""
    swapped = [(layer, getattr(layer, SPLIT)) for _, layer in moe_layers(model)
               if isinstance(getattr(layer, SPLIT), LocalExperts)]
    for layer, local in swapped:
        layer._modules[SPLIT] = nn.ModuleList(local.whole)
    try:
        yield
    finally:
        for layer, local in swapped:
            layer._modules[SPLIT] = local


def expert_peers(model: nn.Module) -> dict[str, list[str]]:
    """For each state-dict key of this rank's experts, the key of the same slot (the same place among the local
    experts) on every rank of the expert group, in rank order; empty without expert parallelism."""
    peers = {}
    for name, layer in moe_layers(model):
        local = getattr(layer, SPLIT)
        if not isinstance(local, LocalExperts):
            continue
        count, degree = len(local), len(local.whole) // len(local)
        for position, expert in enumerate(local):
            for key in expert.state_dict():
                peers[f"{name}.{SPLIT}.{local.first + position}.{key}"] = [
                    f"{name}.{SPLIT}.{rank * count + position}.{key}" for rank in range(degree)]
    return peers


def in_one_process_order(state: dict, model: nn.Module) -> dict:
    """`state` (full, keyed by state-dict name) with each MoE layer's experts in the order of one process's state dict:
    gathered slot by slot over the expert group they come in the ranks' order (0, 2, 1, 3 for 4 experts on 2)."""
    layer_keys = {}  # an expert's key -> every expert key of its layer, in one process's order
    for name, layer in moe_layers(model):
        local = getattr(layer, SPLIT)
        if isinstance(local, LocalExperts):
            keys = [f"{name}.{SPLIT}.{index}.{key}" for index, expert in enumerate(local.whole)
                    for key in expert.state_dict()]
            layer_keys.update(dict.fromkeys(keys, keys))
    if not layer_keys:
        return state
    ordered = {}
    for key in state:
        for name in layer_keys.get(key, [key]):
            if name in state and name not in ordered:
                ordered[name] = state[name]
    return ordered


def one_process_param_groups(param_groups: list[dict], peers: dict[str, list[str]], model: nn.Module) -> list[dict]:
    """An optimizer state's parameter groups (keyed by name) listing every expert of the layers, in one process's
    order, where this rank's list only its own (`peers`): the same on every rank, and a one-process run's."""
    return [{**group, "params": list(in_one_process_order(
        {peer: None for key in group["params"] for peer in peers.get(key, [key])}, model))} for group in param_groups]


def held_elsewhere(model: nn.Module) -> dict[str, torch.Size]:
    """The shapes of the state-dict keys that other ranks hold (a full checkpoint has them): other ranks of the expert
    group their experts, other pipeline ranks their stages (`held_by_other_stages`)."""
    shapes = held_by_other_stages(model)
    for name, layer in moe_layers(model):
        local = getattr(layer, SPLIT)
        if isinstance(local, LocalExperts):
            mine = set(range(local.first, local.first + len(local)))
            for index, expert in enumerate(local.whole):
                if index not in mine:
                    shapes.update({f"{name}.{SPLIT}.{index}.{key}": value.shape
                                   for key, value in expert.state_dict().items()})
    return shapes


def expert_group(model: nn.Module):
    """The process group of this rank's expert group; None without expert parallelism."""
    for _, layer in moe_layers(model):
        if isinstance(layer.dispatch, AllToAllDispatch):
            return layer.dispatch.group
    return None


def gather_across_experts(key: str, full: torch.Tensor, peers: dict[str, list[str]], group) -> dict[str, torch.Tensor]:
    """{key: full} for a tensor every rank holds; for an expert's (`peers`), the same slot's tensor of every rank of
    the expert group under its own key (collective over the group)."""
    if key not in peers:
        return {key: full}
    pieces = [torch.empty_like(full) for _ in peers[key]]
    dist.all_gather(pieces, full.contiguous(), group=group)
    return dict(zip(peers[key], pieces))


def gradient_norm_with_experts(model: nn.Module, expert_mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The gradients' norm over the whole model: the experts' squared norms summed over the expert group (each rank
    holds others), everyone else's as FSDP's DTensors give it (the two live on different meshes)."""
    groups: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    experts = {id(p) for _, layer in moe_layers(model) for p in getattr(layer, SPLIT).parameters()}
    for param in model.parameters():
        if param.grad is not None:
            groups[id(param) in experts].append(param.grad)
    powers = []
    for is_expert, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros(())
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        power = norm.float() ** norm_type
        if is_expert:
            dist.all_reduce(power, group=expert_mesh.get_group())
        powers.append(power)
    return sum(powers) ** (1.0 / norm_type)
