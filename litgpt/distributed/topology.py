"""How a run's processes lay out over nodes and devices, and the mesh over them (data and tensor parallelism):
light to import (no torch until a mesh is built), so `litgpt plan` shares it with training."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import get_args

from litgpt.args import ShardingStrategy
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError

SHARDING_STRATEGIES = get_args(ShardingStrategy)


def check_sharding_strategy(strategy: str, option: str = "--fsdp.sharding_strategy") -> None:
    """UserError unless `strategy` is one of the FSDP sharding strategies; `option` names the flag that set it."""
    if strategy not in SHARDING_STRATEGIES:
        raise UserError(f"{option} {strategy!r} is not one of {', '.join(SHARDING_STRATEGIES)}.")


@dataclass(frozen=True)
class Topology:
    """How the run's processes lay out: `devices` per node on `num_nodes` nodes, and the mesh over them.

    Data parallelism (FSDP) has two dimensions, (replicate, shard): parameters are sharded over the `shard` dimension
    and replicated over the other. With tensor parallelism (`tensor` > 1) a third, innermost dimension `tensor` holds
    the ranks that split each layer (neighbours, on one node), and data parallelism takes the rest of the world:
    HYBRID_SHARD: (num_nodes, devices / tensor); FULL_SHARD and SHARD_GRAD_OP: (1, world / tensor); NO_SHARD:
    (world / tensor, 1). HYBRID_SHARD on one node is FULL_SHARD.

    Expert parallelism (`expert` > 1) borrows from data parallelism: the innermost `expert` data-parallel ranks form
    an expert group (each holds its share of every MoE layer's experts, and each reads its own batches), and the
    ranks holding the same experts shard them by FSDP: `expert_mesh`, (replicate, shard, expert).
    """

    devices: int
    num_nodes: int
    sharding_strategy: str = "HYBRID_SHARD"
    tensor: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        check_sharding_strategy(self.sharding_strategy)
        if self.devices % self.tensor:
            raise UserError(
                f"--parallel.tensor {self.tensor} does not divide --devices {self.devices}: a tensor-parallel group "
                "is that many devices of one node; use a divisor of the devices per node."
            )
        if self.sharding_strategy == "HYBRID_SHARD" and self.num_nodes == 1:
            print_once("Note: HYBRID_SHARD replicates across nodes and shards within one; on one node it is FULL_SHARD.",
                       file=sys.stderr)
            object.__setattr__(self, "sharding_strategy", "FULL_SHARD")
        if self.expert > 1:
            self.expert_mesh_shape  # refuses a degree the mesh cannot carve

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches: the world over the tensor-parallel degree."""
        return self.world_size // self.tensor

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batches rank `global_rank` reads: the ranks of one tensor-parallel group (neighbours) read the same."""
        return global_rank // self.tensor

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The data-parallel (replicate, shard) shape."""
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.num_nodes, self.devices // self.tensor
        if self.sharding_strategy == "NO_SHARD":
            return self.data_parallel_size, 1
        return 1, self.data_parallel_size

    def device_mesh(self, device_type: str):
        """The run's mesh: (replicate, shard), or (replicate, shard, tensor) with tensor parallelism."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise UserError(
                f"{dist.get_world_size()} processes joined the run, but --devices {self.devices} x --num_nodes "
                f"{self.num_nodes} makes {self.world_size}."
            )
        if self.tensor == 1:
            return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (*self.mesh_shape, self.tensor),
                                mesh_dim_names=("replicate", "shard", "tensor"))

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int]:
        """(replicate, shard, expert) of the experts' mesh: data-parallel rank d = (r * shard + s) * expert + e holds
        expert group e's share, sharded by FSDP over the shard ranks and replicated over the replicate ranks. The
        expert groups take the innermost data-parallel ranks: within the shard dimension when `expert` divides it,
        else whole shard groups of the replicate dimension (NO_SHARD, or groups spanning nodes)."""
        replicate, shard = self.mesh_shape
        if self.tensor > 1:
            raise UserError(f"--parallel.expert {self.expert} with --parallel.tensor {self.tensor} is not supported yet: "
                            "use one of the two.")
        if self.data_parallel_size % self.expert:
            raise UserError(f"--parallel.expert {self.expert} does not divide the {self.data_parallel_size} "
                            "data-parallel devices (--devices x --num_nodes): use a divisor of them.")
        if shard % self.expert == 0:
            return replicate, shard // self.expert, self.expert
        if self.expert % shard == 0:
            return self.data_parallel_size // self.expert, 1, self.expert
        raise UserError(f"--parallel.expert {self.expert} neither divides nor is a multiple of the {shard} devices "
                        f"FSDP shards over ({self.sharding_strategy}): choose a degree that is.")

    def expert_device_mesh(self, device_type: str):
        """The experts' mesh (`expert_mesh_shape`), named ("expert_replicate", "expert_shard", "expert"); every rank
        must build it (its process groups are made together)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world_size).view(self.expert_mesh_shape)
        return DeviceMesh(device_type, ranks, mesh_dim_names=("expert_replicate", "expert_shard", "expert"))


def data_parallel(fabric) -> tuple[int, int]:
    """(rank, size) of this process among the ranks that read different batches: the global ones, except under
    tensor parallelism, where the ranks of a tensor-parallel group read one batch together."""
    topology = getattr(fabric.strategy, "topology", None)
    if isinstance(topology, Topology):
        return topology.data_parallel_rank(fabric.global_rank), topology.data_parallel_size
    return fabric.global_rank, fabric.world_size
