"""PyTorch's colwise and rowwise parallel styles, extended to place LoRA factors (`litgpt.lora.LoRALinear`) as well:
the placements of each kind of parameter are data (`COLWISE`, `ROWWISE`), the styles read them.

Next to a colwise base (split by output rows) A is whole on every rank and B split by output rows like the base: each
rank adds the update of its own rows. Next to a rowwise base (split by input columns) A is split by input columns like
the base and B whole: each rank's update is a partial sum, reduced with the base's.

A colwise adapter computes its update on the rank's own rows (`local_update`): the fused qkv stores its rows permuted
per rank (`litgpt.distributed.plans.dense.qkv_row_order`) while its B factors, one per part (q, k, v), are split
plainly, so rank r's piece of each B is that part's rows of rank r's heads, and the rank's output rows are
[q_r | k_r | v_r]: each part's rows are its global rows over the degree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from litgpt.lora import LORA_PREFIX, LoRALinear, stacked_rows

# Parameter kind -> placement: the base's `weight` and `bias`, and the LoRA factors `lora_A*` and `lora_B*`.
COLWISE = {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(), "lora_B": Shard(0)}
ROWWISE = {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1), "lora_B": Replicate()}


def parameter_kind(name: str) -> str:
    """`weight`, `bias`, `lora_A` or `lora_B` (what `lora_A_q` and `lora_B` are)."""
    return name[:len(LORA_PREFIX) + 1] if name.startswith(LORA_PREFIX) else name


def place_parameters(module: nn.Module, mesh, placements: dict[str, Placement], src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements[parameter_kind(name)]], src_data_rank=src_data_rank)
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
