"""PyTorch's colwise and rowwise parallel styles, extended to place LoRA factors (`litgpt.lora.LoRALinear`) as well:
the placements of each kind of parameter are data (`COLWISE`, `ROWWISE`), the styles read them; and the styles of
what the model computes on local tensors beside them: a module computed whole on every rank (`Replicated`), a
module computed on its input's shard (`ShardedInput`: norms over the rank's heads), parameters read as this rank's
pieces where the module computes on local tensors (`LocalParameters`: attention sinks, split by heads; latent
attention's decoding step), a gradient summed over the ranks where each rank's readers give their share
(`SummedGradientOf`: latent attention's rotary key), a mixture-of-experts layer whose every expert is split by its
width (`ExpertsTensorParallel`).

Next to a colwise base (split by output rows) A is whole on every rank and B split by output rows like the base: each
rank adds the update of its own rows. Next to a rowwise base (split by input columns) A is split by input columns like
the base and B whole: each rank's update is a partial sum, reduced with the base's.

A colwise adapter computes its update on the rank's own rows (`local_update`): the fused qkv stores its rows permuted
per rank (`litgpt.distributed.plans.dense.qkv_row_order`) while its B factors, one per part (q, k, v), are split
plainly, so rank r's piece of each B is that part's rows of rank r's heads, and the rank's output rows are
[q_r | k_r | v_r]: each part's rows are its global rows over the degree.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from litgpt.distributed.dtensor import summed_gradient
from litgpt.lora import LORA_PREFIX, LoRALinear, stacked_rows
from litgpt.moe import LLaMAMoE

# Parameter kind -> placement: the base's `weight` and `bias`, and the LoRA factors `lora_A*` and `lora_B*`.
COLWISE = {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}
ROWWISE = {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1), "lora_B": Replicate()}


def parameter_kind(name: str) -> str:
    """`weight`, `bias`, `lora_A` or `lora_B` (what `lora_A_q` and `lora_B` are)."""
    return name[:len(LORA_PREFIX) + 1] if name.startswith(LORA_PREFIX) else name


def place_parameters(module: nn.Module, mesh, placements: dict[str, Placement], src_data_rank,
                     default: Placement | None = None) -> None:
    """The module's own parameters as DTensors on `mesh`, each placed by its kind (`placements`, else `default`)."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(parameter_kind(name), default)
        placed = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """`ColwiseParallel` of a linear layer, its LoRA factors placed by `COLWISE` and its update `local_update`."""

    def _partition_linear_fn(self, name, module, device_mesh):
        place_parameters(module, device_mesh, COLWISE, self.src_data_rank)
        if isinstance(module, LoRALinear):
            module.forward = colwise_adapted_forward(module, device_mesh.size())


class Rowwise(RowwiseParallel):
    """`RowwiseParallel` of a linear layer, its LoRA factors placed by `ROWWISE`; the layer's own forward computes
    (x's columns, A's columns: a partial sum, as the base's output is)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        place_parameters(module, device_mesh, ROWWISE, self.src_data_rank)


def colwise_adapted_forward(layer: LoRALinear, degree: int):
    """The forward of a colwise-split `layer`: its base on the DTensors, the update on the rank's own rows."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer.base_forward(x)  # Shard(-1): this rank's output rows, in their stored order
        if not layer.applies_update:
            return out
        update = local_update(layer, x, degree).to(out.dtype)
        return out + DTensor.from_local(update, out.device_mesh, out.placements, run_check=False)

    return forward


def local_update(layer: LoRALinear, x: DTensor, degree: int) -> torch.Tensor:
    """This rank's rows of the update of a colwise `layer` (x replicated), as a local tensor: each part's rows are
    its global rows over `degree`, B's local piece holds them."""
    # Each rank's rows contribute their own share of the gradient of dropout(x) A^T (thus of A's): a partial sum.
    low_rank = layer.adapter_input(x).to_local(grad_placements=(Partial(),))
    parts = [(start // degree, stop // degree, b.to_local()) for _, start, stop, _, b in layer.lora_factors()]
    return F.linear(low_rank, stacked_rows(parts, layer.out_features // degree, layer.r))


# ---- what runs on local tensors --------------------------------------------------------------------------------------
class Replicated(ParallelStyle):
    """A module computed whole on every rank (a router; latent attention's down-projections and their norms): its
    parameters replicated (buffers stay plain tensors: the router's correction bias meets local scores), its input
    and output local tensors. Its output's gradient must be whole on every rank: the colwise layers that read it sum
    theirs over the ranks, other readers by `summed_gradient`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate(name, submodule, mesh):
            place_parameters(submodule, mesh, {}, None, default=Replicate())

        def to_dtensors(module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        distribute_module(module, device_mesh, replicate, to_dtensors, lambda module, output, mesh: output.to_local())
        for submodule in module.modules():  # `distribute_module` replicates the buffers too: back to plain tensors
            for name, buffer in submodule._buffers.items():
                if isinstance(buffer, DTensor):
                    submodule._buffers[name] = buffer.to_local()
        return module


class ShardedInput(ParallelStyle):
    """A module computed on the rank's piece of its input, split along `dim` (query/key norms on the rank's heads):
    its input and output local tensors, its parameters placed by `placements` (parameter kind -> placement, else
    replicated: their gradients are summed over the ranks)."""

    def __init__(self, dim: int, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.dim, self.placements = dim, placements

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        shard = [Shard(self.dim)]

        def place(name, submodule, mesh):
            place_parameters(submodule, mesh, self.placements, self.src_data_rank, default=Replicate())

        def to_dtensor(module, inputs, mesh):
            return (DTensor.from_local(inputs[0], mesh, shard, run_check=False), *inputs[1:])

        def to_local(module, output, mesh):
            return output.redistribute(placements=shard).to_local()

        return distribute_module(module, device_mesh, place, to_dtensor, to_local)


class SummedGradientOf(ParallelStyle):
    """The gradient of argument `argument` of the module's method `method` summed over the ranks (`summed_gradient`):
    latent attention's rotary key, which each rank's heads read, when its heads expand it."""

    def __init__(self, method: str, argument: int) -> None:
        super().__init__()
        self.method, self.argument = method, argument

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        method, index = getattr(module, self.method), self.argument

        def with_summed_gradient(*args):
            args = list(args)
            args[index] = summed_gradient(args[index], device_mesh)
            return method(*args)

        setattr(module, self.method, with_summed_gradient)
        return module


@contextlib.contextmanager
def local_views(views: list[tuple[nn.Module, str, Callable[[DTensor], torch.Tensor]]]) -> Iterator[None]:
    """Inside, each (module, name, view): the module's parameter `name` (a DTensor) read as `view(parameter)`, a
    local tensor in the autograd graph (`DTensor.to_local` with the placement its local gradient has), for code
    that computes on local tensors; the parameters themselves are back afterwards."""
    placed = [(module, name, module._parameters[name]) for module, name, _ in views]
    try:
        for (module, name, param), (_, _, view) in zip(placed, views):
            module._parameters[name] = view(param)
        yield
    finally:
        for module, name, param in placed:
            module._parameters[name] = param


class LocalParameters(ParallelStyle):
    """Parameters of the module or of its submodules (dotted names) read as this rank's pieces while the module's
    `method` runs: attention sinks, one per head, placed here split with the heads (Shard(0)), in its forward; latent
    attention's kv_b_proj weight, placed by its own colwise style (placement None: left as it is), in the decoding
    step that folds the rank's heads' rows of it into their queries (`attend_latent`)."""

    def __init__(self, placements: dict[str, Optional[Placement]], method: str = "forward") -> None:
        super().__init__()
        self.placements, self.method = placements, method

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        views = []
        for name, placement in self.placements.items():
            path, _, param_name = name.rpartition(".")
            owner = module.get_submodule(path)
            if placement is not None:
                param = owner._parameters[param_name]
                placed = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
                owner.register_parameter(param_name, nn.Parameter(placed, requires_grad=param.requires_grad))
            views.append((owner, param_name, DTensor.to_local))
        method = getattr(module, self.method)

        def on_local_pieces(*args, **kwargs):
            with local_views(views):
                return method(*args, **kwargs)

        setattr(module, self.method, on_local_pieces)
        return module


# An expert's parameters as the grouped kernels read them (local tensors), by parameter kind, with the placement of
# their local gradients: a replicated factor's gradient on a rank is its share of the sum (the rank's rows of a
# colwise layer, the rank's partial sums of a rowwise one), and a rowwise layer's bias, added on every rank to
# partial sums that are then summed, is read as bias / degree.
def _local(param: DTensor) -> torch.Tensor:
    return param.to_local()


def _local_share_of_sum(param: DTensor) -> torch.Tensor:
    return param.to_local(grad_placements=[Partial()])


def _local_partial(param: DTensor) -> torch.Tensor:
    return param.to_local(grad_placements=[Partial()]) / param.device_mesh.size()


EXPERT_COLWISE_VIEWS = {"weight": _local, "bias": _local, "lora_A": _local_share_of_sum, "lora_B": _local}
EXPERT_ROWWISE_VIEWS = {"weight": _local, "bias": _local_partial, "lora_A": _local, "lora_B": _local_share_of_sum}


class ExpertsTensorParallel(ParallelStyle):
    """Tensor parallelism on a mixture-of-experts layer's routed experts (torchtitan's "TP on experts"): every expert
    split along its width, its `colwise` inputs (fc_1, fc_2) by output rows and its `rowwise` output (proj) by input
    columns, so the grouped kernels run every expert on the rank's share of its width, over all of the layer's rows
    (`TensorParallelExperts`). The layer's output is then a partial sum, reduce-scattered onto the sequence by the
    plan's output style; the routing weights' gradient (each rank's partial outputs give their share of it) is summed
    over the ranks, the router's own stays whole (its auxiliary loss reads the same routing on every rank)."""

    def __init__(self, colwise: tuple[str, ...], rowwise: tuple[str, ...]) -> None:
        super().__init__()
        self.colwise, self.rowwise = colwise, rowwise

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, LLaMAMoE):
            raise TypeError(f"ExpertsTensorParallel splits a mixture-of-experts layer, not {type(module).__name__}.")
        degree, views = device_mesh.size(), []
        for expert in module.experts:
            for names, placements, kind_views in ((self.colwise, COLWISE, EXPERT_COLWISE_VIEWS),
                                                  (self.rowwise, ROWWISE, EXPERT_ROWWISE_VIEWS)):
                for name in names:
                    linear = getattr(expert, name)
                    place_parameters(linear, device_mesh, placements, self.src_data_rank)
                    views += [(linear, param, kind_views[parameter_kind(param)])
                              for param, _ in linear.named_parameters(recurse=False)]
                    if placements is COLWISE:  # the widths the kernels split their outputs by
                        linear.out_features //= degree
                    else:
                        linear.in_features //= degree
        module.dispatch = TensorParallelExperts(views, device_mesh)
        route = module.route

        def route_with_summed_gradient(x: torch.Tensor) -> tuple:
            weights, chosen, scores = route(x)
            return summed_gradient(weights, device_mesh), chosen, scores

        module.route = route_with_summed_gradient
        return module


class TensorParallelExperts:
    """The `litgpt.moe.ExpertDispatch` of a layer whose experts are split by their width: every rank runs the same
    rows (its layer's whole input) through its share of every expert (`views`: the experts' parameters read as local
    tensors) and returns partial sums; the rows' gradient, each rank's share, is summed over the ranks."""

    def __init__(self, views: list, mesh) -> None:
        self.views, self.mesh = views, mesh

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run_local: Callable) -> torch.Tensor:
        # each row's expert; the output size given: no read back to the host
        experts = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                          output_size=rows.size(0))
        return self.run(rows, experts, run_local)

    def run(self, rows: torch.Tensor, experts: torch.Tensor, run_local: Callable) -> torch.Tensor:
        """`run_local(rows, experts)` on the rank's share of every expert's width: partial sums. Expert parallelism
        calls this on the rows its all-to-all brought (`litgpt.distributed.expert_parallel.AllToAllDispatch`)."""
        with local_views(self.views):
            return run_local(summed_gradient(rows, self.mesh), experts)

    def restricted_to(self, experts: nn.Module) -> "TensorParallelExperts":
        """The same split over `experts` alone (the experts expert parallelism leaves this rank)."""
        mine = {id(module) for module in experts.modules()}
        return TensorParallelExperts([view for view in self.views if id(view[0]) in mine], self.mesh)
