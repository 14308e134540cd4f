"""How a run's processes lay out over nodes and devices, and the FSDP mesh over them: light to import (no torch until
a mesh is built), so `litgpt plan` shares it with training."""

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
    """How the run's processes lay out: `devices` per node on `num_nodes` nodes, and the FSDP mesh over them.

    The mesh has two dimensions, (replicate, shard): parameters are sharded over the `shard` dimension and
    replicated over the other. HYBRID_SHARD: (num_nodes, devices); FULL_SHARD and SHARD_GRAD_OP: (1, world);
    NO_SHARD: (world, 1). HYBRID_SHARD on one node is FULL_SHARD.
    """

    devices: int
    num_nodes: int
    sharding_strategy: str = "HYBRID_SHARD"

    def __post_init__(self) -> None:
        check_sharding_strategy(self.sharding_strategy)
        if self.sharding_strategy == "HYBRID_SHARD" and self.num_nodes == 1:
            print_once("Note: HYBRID_SHARD replicates across nodes and shards within one; on one node it is FULL_SHARD.",
                       file=sys.stderr)
            object.__setattr__(self, "sharding_strategy", "FULL_SHARD")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def mesh_shape(self) -> tuple[int, int]:
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.num_nodes, self.devices
        if self.sharding_strategy == "NO_SHARD":
            return self.world_size, 1
        return 1, self.world_size

    def device_mesh(self, device_type: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise UserError(
                f"{dist.get_world_size()} processes joined the run, but --devices {self.devices} x --num_nodes "
                f"{self.num_nodes} makes {self.world_size}."
            )
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))
