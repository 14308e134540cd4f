"""How a run's processes lay out over nodes and devices, and the mesh over them (data, tensor, context and expert
parallelism): light to import (no torch until a mesh is built), so `litgpt plan` shares it with training."""

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

    Expert parallelism (`expert` > 1) borrows from data parallelism, as torchtitan's does: the innermost `expert`
    data-parallel ranks form an expert group (each holds its share of every MoE layer's experts, and each reads its
    own batches), and the ranks holding the same experts shard them by FSDP: `expert_mesh`, (replicate, shard,
    expert), carved from the same mesh. With tensor parallelism too, an expert group is the ranks of `expert`
    tensor-parallel groups that share a tensor rank (the all-to-all runs among them), and every expert is also split
    along its width over the tensor dimension: a rank holds n_expert / expert experts, each 1 / tensor wide.

    Context parallelism (`context` > 1) adds a dimension `context` between the data-parallel ones and `tensor`: the
    ranks of one context-parallel group read the same batches (each runs its own slice of the positions), and FSDP
    shards over (shard, context) flattened (parameters are the same on every context rank), as torchtitan does.
    Expert parallelism beside it carves its expert groups from these ranks, a context group's first.

    Pipeline parallelism (`pipeline` > 1) adds the outermost dimension `pipeline`: global rank p x (world / pipeline)
    + d runs pipeline rank p's `stages_per_rank` stages (placed by `pipeline_schedule`: looped, or in a V), the ranks
    of one pipeline group read the same batches, and the data-parallel shape above is that of the world / pipeline
    ranks of one pipeline rank (HYBRID_SHARD's replicate dimension: the nodes of one pipeline rank).
    """

    devices: int
    num_nodes: int
    sharding_strategy: str = "HYBRID_SHARD"
    tensor: int = 1
    expert: int = 1
    context: int = 1
    pipeline: int = 1
    stages_per_rank: int = 1
    pipeline_schedule: str = "1F1B"
    context_attention: str = "auto"  # --parallel.context_attention

    def __post_init__(self) -> None:
        check_sharding_strategy(self.sharding_strategy)
        if self.pipeline > 1:
            self.check_pipeline()
        if self.devices % self.tensor:
            raise UserError(
                f"--parallel.tensor {self.tensor} does not divide --devices {self.devices}: a tensor-parallel group "
                "is that many devices of one node; use a divisor of the devices per node."
            )
        if self.context > 1:
            self.check_context()
        if self.sharding_strategy == "HYBRID_SHARD" and self.num_nodes == 1:
            print_once("Note: HYBRID_SHARD replicates across nodes and shards within one; on one node it is FULL_SHARD.",
                       file=sys.stderr)
            object.__setattr__(self, "sharding_strategy", "FULL_SHARD")
        if self.expert > 1:
            self.expert_mesh_shape  # refuses a degree the mesh cannot carve

    def check_context(self) -> None:
        """UserError unless the context-parallel groups fit: on one node beside the tensor-parallel ones."""
        if self.devices % (self.tensor * self.context):
            raise UserError(
                f"--parallel.context {self.context} x --parallel.tensor {self.tensor} does not divide --devices "
                f"{self.devices}: a context-parallel group is that many devices of one node; use a divisor of them."
            )

    def check_pipeline(self) -> None:
        """UserError unless the pipeline groups fit: the degree divides the world and the nodes (or one node holds
        whole pipeline groups)."""
        if self.world_size % self.pipeline:
            raise UserError(f"--parallel.pipeline {self.pipeline} does not divide the {self.world_size} devices "
                            "(--devices x --num_nodes): use a divisor of them.")
        if self.sharding_strategy == "HYBRID_SHARD" and self.num_nodes > 1 and self.num_nodes % self.pipeline:
            raise UserError(f"--parallel.pipeline {self.pipeline} does not divide the {self.num_nodes} nodes, which "
                            "HYBRID_SHARD replicates over: use a divisor of them, or --fsdp.sharding_strategy "
                            "FULL_SHARD.")

    @property
    def model_parallel_size(self) -> int:
        """The neighbouring ranks that read one batch together: a tensor-parallel group times a context-parallel one."""
        return self.tensor * self.context

    @property
    def fsdp_shard_size(self) -> int:
        """How many ranks FSDP shards each parameter over: the shard dimension, times the context dimension."""
        return self.mesh_shape[1] * self.context

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches: the world over the pipeline, tensor and context-parallel degrees."""
        return self.world_size // (self.pipeline * self.model_parallel_size)

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batches rank `global_rank` reads: the ranks of one tensor (and context) parallel group, neighbours,
        read the same, and so do the ranks of one pipeline group (the same place in each pipeline rank's share)."""
        return global_rank % (self.world_size // self.pipeline) // self.model_parallel_size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The data-parallel (replicate, shard) shape."""
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.num_nodes // self.pipeline, self.devices // self.model_parallel_size
        if self.sharding_strategy == "NO_SHARD":
            return self.data_parallel_size, 1
        return 1, self.data_parallel_size

    def device_mesh(self, device_type: str):
        """The run's mesh: "pipeline" with pipeline parallelism (outermost), (replicate, shard), then "context" with
        context parallelism, then "tensor" with tensor parallelism (innermost)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise UserError(
                f"{dist.get_world_size()} processes joined the run, but --devices {self.devices} x --num_nodes "
                f"{self.num_nodes} makes {self.world_size}."
            )
        dims = [("pipeline", self.pipeline)] if self.pipeline > 1 else []
        dims += [("replicate", self.mesh_shape[0]), ("shard", self.mesh_shape[1])]
        dims += [(name, size) for name, size in (("context", self.context), ("tensor", self.tensor)) if size > 1]
        return init_device_mesh(device_type, tuple(size for _, size in dims),
                                mesh_dim_names=tuple(name for name, _ in dims))

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int]:
        """(replicate, shard, expert) of the experts' mesh: of the ranks FSDP spreads a parameter over (replicate x
        shard, the shard dimension with the context ranks inside it: `fsdp_shard_size`), rank d = (r * shard + s) *
        expert + e holds expert group e's share, sharded by FSDP over the shard ranks and replicated over the
        replicate ranks. The expert groups take the innermost of these ranks: within the shard dimension when
        `expert` divides it (with context parallelism the ranks of a context group first: each routes its own
        positions), else whole shard groups of the replicate dimension (NO_SHARD, or groups spanning nodes)."""
        replicate, shard = self.mesh_shape[0], self.fsdp_shard_size
        ranks = replicate * shard
        if ranks % self.expert:
            what = "data-parallel x context-parallel" if self.context > 1 else "data-parallel"
            raise UserError(f"--parallel.expert {self.expert} does not divide the {ranks} {what} devices "
                            "(--devices x --num_nodes): use a divisor of them.")
        if shard % self.expert == 0:
            return replicate, shard // self.expert, self.expert
        if self.expert % shard == 0:
            return ranks // self.expert, 1, self.expert
        raise UserError(f"--parallel.expert {self.expert} neither divides nor is a multiple of the {shard} devices "
                        f"FSDP shards over ({self.sharding_strategy}): choose a degree that is.")

    def expert_device_mesh(self, device_mesh):
        """The experts' mesh (`expert_mesh_shape`), named ("expert_replicate", "expert_shard", "expert"): the
        data-parallel dimensions of the run's `device_mesh` (`device_mesh`) flattened and laid out again, so both
        share one root and FSDP composes the experts' tensor-parallel pieces with their shards (its "tensor"
        dimension, when there is one, stays innermost: an expert group shares a tensor rank). Every rank must build
        it (its process groups are made together)."""
        return self.data_parallel_device_mesh(device_mesh)._unflatten(
            0, self.expert_mesh_shape, ("expert_replicate", "expert_shard", "expert"))

    def data_parallel_device_mesh(self, device_mesh):
        """The ranks of the run's `device_mesh` that FSDP spreads a parameter over (replicate, shard, and with
        context parallelism the context ranks inside shard) as one dimension, "data_parallel": the flattened mesh
        itself, kept by whoever lays it out again (slicing a flattened dimension from the root mesh is deprecated).
        Made once by every rank; later calls return the same mesh."""
        dims = ("replicate", "shard", "context") if self.context > 1 else ("replicate", "shard")
        return device_mesh[dims]._flatten("data_parallel")

    def fsdp_device_mesh(self, device_mesh):
        """The (replicate, shard) mesh FSDP shards over; with context parallelism (replicate, shard_context): the
        shard and context ranks together, laid out from `data_parallel_device_mesh` on the run's root mesh. Every rank
        must build it (its process groups are made together)."""
        if self.context == 1:
            return device_mesh["replicate", "shard"]
        return self.data_parallel_device_mesh(device_mesh)._unflatten(
            0, (self.mesh_shape[0], self.fsdp_shard_size), ("replicate", "shard_context"))


def data_parallel(fabric) -> tuple[int, int]:
    """(rank, size) of this process among the ranks that read different batches: the global ones, except under
    tensor or context parallelism, where the ranks of a tensor (x context) parallel group read one batch together."""
    topology = getattr(fabric.strategy, "topology", None)
    if isinstance(topology, Topology):
        return topology.data_parallel_rank(fabric.global_rank), topology.data_parallel_size
    return fabric.global_rank, fabric.world_size
