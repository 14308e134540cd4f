"""FSDP2: the mesh (`Topology`), the Fabric strategy that applies `fully_shard` over it, and reading and writing the
pieces of sharded tensors (DTensor) so that no process ever holds the whole model.

Built on `torch.distributed.fsdp.fully_shard` (not Lightning's FSDP1 strategy), so it runs on CPU with gloo as well
as on CUDA with NCCL.
"""

from __future__ import annotations

import contextlib
import types
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from litgpt.args import FSDPArgs
from litgpt.distributed.dtensor import clip_to_norm
from litgpt.distributed.launcher import RankLauncher
from litgpt.distributed.topology import Topology
from litgpt.model import numbered_blocks
from litgpt.precision import Precision





class FSDPStrategy(ModelParallelStrategy):
    """Fabric's model-parallel strategy with FSDP2: `fully_shard` on each Block, then on the root, over our mesh.

    Built on `torch.distributed.fsdp.fully_shard` (not Lightning's FSDP1 strategy), so it runs on CPU with gloo as
    well as on CUDA with NCCL.
    """

    def __init__(self, topology: Topology, fsdp: FSDPArgs) -> None:
        # Checkpoints are written by litgpt.checkpoint (full or sharded), not through Fabric's save/load.
        super().__init__(parallelize_fn=self._parallelize, timeout=timedelta(seconds=fsdp.timeout))
        self.topology = topology
        self.fsdp = fsdp
        if topology.fsdp_shard_size > 1:
            # Skipping the gradient sync during accumulation would hold every gradient unsharded until the last
            # micro-batch: the memory FSDP exists to save. Sharded strategies reduce-scatter after every micro-batch.
            self._backward_sync_control = ReduceEveryMicroBatch()

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not the parent's (data, tensor) mesh: ours is (replicate, shard)
        self._setup_distributed()
        self._device_mesh = self.topology.device_mesh(self.root_device.type)
        self._data_mesh = self.topology.fsdp_device_mesh(self._device_mesh)
        self._context_parallel = None
        self._pipeline = None
        self._expert_mesh = None
        if self.topology.expert > 1:
            self._expert_mesh = self.topology.expert_device_mesh(self._device_mesh)

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = RankLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @property
    def distributed_sampler_kwargs(self) -> dict:  # the parent reads a "data_parallel" mesh dimension we do not have
        # The ranks of one tensor-parallel group read the same batches.
        return {"num_replicas": self.topology.data_parallel_size,
                "rank": self.topology.data_parallel_rank(self.global_rank)}

    @property
    def data_mesh(self):
        """The (replicate, shard) mesh FSDP shards over; with context parallelism (replicate, shard x context)."""
        return self._data_mesh

    @property
    def tensor_mesh(self):
        """The 1-D mesh of this rank's tensor-parallel group; None without tensor parallelism."""
        return None if self.topology.tensor == 1 else self.device_mesh["tensor"]

    @property
    def context_parallel(self):
        """This rank's context-parallel group (`litgpt.distributed.context_parallel.ContextParallel`), one for the
        run's models and its loss; None without context parallelism."""
        if self.topology.context > 1 and self._context_parallel is None:
            from litgpt.distributed.context_parallel import ContextParallel

            ring = self.topology.context_attention == "auto" and self.root_device.type == "cuda"
            self._context_parallel = ContextParallel(self.device_mesh["context"], self.topology.tensor, ring)
        return self._context_parallel

    @property
    def pipeline(self):
        """This rank's pipeline group and its stages' layout (`litgpt.distributed.pipeline.Pipeline`); None without
        pipeline parallelism."""
        if self.topology.pipeline > 1 and self._pipeline is None:
            from litgpt.distributed.pipeline import Pipeline

            self._pipeline = Pipeline(self.device_mesh["pipeline"], self.topology)
        return self._pipeline

    @property
    def expert_mesh(self):
        """The experts' (expert_replicate, expert_shard, expert) mesh (`Topology.expert_mesh_shape`); None without
        expert parallelism."""
        return self._expert_mesh

    def clip_gradients_norm(self, module: nn.Module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.pipeline is None and self._expert_mesh is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        norm = self.gradient_norm(module, norm_type)
        clip_to_norm([p.grad for p in module.parameters() if p.grad is not None], norm, max_norm)
        return norm

    def gradient_norm(self, module: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of `module`'s gradients over all ranks, without clipping them: with expert parallelism the
        experts' summed over their group (`gradient_norm_with_experts`); with pipeline parallelism each rank holds
        its stages' parameters, so the norm sums over the pipeline group."""
        if self._expert_mesh is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None], norm_type)
        else:
            from litgpt.distributed.expert_parallel import gradient_norm_with_experts

            norm = gradient_norm_with_experts(module, self._expert_mesh["expert"], norm_type)
        return norm if self.pipeline is None else self.pipeline.summed_norm(norm, norm_type)

    def _parallelize(self, module: nn.Module, mesh) -> nn.Module:
        # One road to FSDP: `litgpt.distributed.parallelize` shards (with the run's precision) before materializing;
        # a pipeline rank's model holds its stages, each sharded on its own.
        if not is_sharded(module) and not all(is_sharded(stage) for stage in getattr(module, "stages", [None])):
            raise RuntimeError("FSDPStrategy sets up models that litgpt.distributed.parallelize has sharded.")
        return module


class ReduceEveryMicroBatch(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        return contextlib.nullcontext()


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def shard_model(model: nn.Module, mesh, fsdp: FSDPArgs, precision: Precision, device: torch.device,
                prepare_block: Optional[Callable[[int, nn.Module], None]] = None, expert_mesh=None,
                pipeline_stage: bool = False) -> None:
    """FSDP2 over each transformer Block (the wrap unit), the token embedding (`embedding_unit`), the output head
    (`head_unit`), then the root: the final norm (with a tied embedding or a head of its own, those; a pipeline
    stage's ends).

    `prepare_block(index, block)` runs just before a block is sharded (QLoRA puts the block's 4-bit base weights in
    there), so a rank holds the whole of at most one block's weights that exist before sharding. Under expert
    parallelism each MoE layer's local experts are a unit of their own, sharded over `expert_mesh`'s (expert_replicate,
    expert_shard) ranks, those that hold the same experts (`shard_experts`). Parameters that
    are not on the meta device must be on `device`; FSDP keeps this rank's piece of them (in CPU memory with
    `cpu_offload`) and frees the rest. `pipeline_stage`: `model` is a pipeline stage.
    """
    compute = precision.sharded_compute_dtype
    # bf16 compute and all-gathers; gradients are reduced and kept in float32 with the float32 master weights.
    mp_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    # SHARD_GRAD_OP keeps a block's parameters gathered from its forward to its backward, and so does a pipeline
    # stage (`pipeline_stage`), as torchtitan's do: its micro-batches' forward and backward passes interleave, and a
    # zero-bubble schedule's split backward pass finds the weights it differentiates by the gathered parameters.
    reshard = fsdp.sharding_strategy != "SHARD_GRAD_OP" and not pipeline_stage
    for index, block in numbered_blocks(model.transformer.h):
        if prepare_block is not None:
            prepare_block(index, block)
        if expert_mesh is not None:
            shard_experts(block, expert_mesh, dict(reshard_after_forward=reshard, mp_policy=mp_policy,
                                                   offload_policy=offload))
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload,
                    ignored_params=frozen_unshardable(block, mesh))
    embedding = None if pipeline_stage else embedding_unit(model)
    if embedding is not None:
        fully_shard(embedding, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    head = None if pipeline_stage else head_unit(model)
    if head is not None:
        fully_shard(head, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
        # FSDP gathers a unit around its forward only; the chunked loss reads the head's tensors without calling it,
        # so the loss runs through a method that FSDP treats as a forward of the head (`call_in_unit`).
        setattr(head, UNIT_CALL, types.MethodType(lambda self, function, *args: function(*args), head))
        register_fsdp_forward_method(head, UNIT_CALL)
    # The root's parameters (final norm; a head left in it) stay gathered: the backward pass begins with the loss.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
    if mesh.shape[-1] > 1:  # a shard group of one device gathers nothing: nothing to issue ahead
        set_prefetching(list(model.transformer.h), fsdp.forward_prefetch, fsdp.backward_prefetch)


def embedding_unit(model: nn.Module) -> Optional[nn.Module]:
    """The token embedding as an FSDP unit of its own, as torchtune and torchtitan shard it: gathered for its forward
    and, where it trains, again at the end of the backward pass, and its gradient reduce-scattered there, where in
    the root it would stay gathered through the step. None where it is the head's weight too (tied), which the root
    keeps gathered for the loss."""
    return None if model.lm_head.weight is model.transformer.wte.weight else model.transformer.wte


UNIT_CALL = "call_in_unit"  # the method of a head unit that runs a function of it within the unit's gathers


def head_unit(model: nn.Module) -> Optional[nn.Module]:
    """The output head as an FSDP unit of its own, as torchtune shards it (`custom_sharded_layers`): gathered for the
    loss (`call_in_unit`) and freed after it; in the backward pass gathered again for the loss's backward and its
    gradient reduce-scattered there, before the blocks' backward passes begin, where in the root it would stay
    gathered, and its whole gradient kept, through the step. None for a head tied to the embedding, one split by
    tensor parallelism (a DTensor already, whose loss runs on each rank's rows), and a model that does not train (a
    frozen teacher or reference, whose root keeps the head gathered for the losses that read it,
    `Recipe.frozen_model`)."""
    head = model.lm_head
    if head.weight is model.transformer.wte.weight or isinstance(head.weight, DTensor):
        return None
    return head if any(p.requires_grad for p in model.parameters()) else None


def gathered_dtype(module: FSDPModule) -> Optional[torch.dtype]:
    """The dtype FSDP2 gathers `module`'s weights in (its mixed-precision policy's), None where they keep their own."""
    return module._get_fsdp_state()._mp_policy.param_dtype


def call_in_unit(module: FSDPModule, function: Callable[..., Any], *args) -> Any:
    """`function(*args)` within `module`'s FSDP unit, which `shard_model` gave a `UNIT_CALL` method (`head_unit`):
    its weights gathered for it, and in the backward pass the gradients of the tensors in `args` mark where the
    unit's gradients are complete (reduce-scattered there)."""
    return getattr(module, UNIT_CALL)(function, *args)


def shard_experts(block: nn.Module, expert_mesh, options: dict) -> None:
    """FSDP2 over each of the block's `LocalExperts` on the ranks holding the same experts (FSDP averages their
    gradients over those ranks; `AllToAllDispatch` divides them by the expert group's size beforehand)."""
    from litgpt.distributed.expert_parallel import LocalExperts

    for module in block.modules():
        if isinstance(module, LocalExperts):
            fully_shard(module, mesh=expert_mesh["expert_replicate", "expert_shard"], **options)


def set_prefetching(blocks: list[FSDPModule], forward: int, backward: int) -> None:
    """FSDP2's explicit prefetching (`--fsdp.forward_prefetch`, `--fsdp.backward_prefetch`): in the forward pass
    block i issues the all-gathers of blocks i+1..i+forward, in the backward pass those of blocks i-1..i-backward,
    nearest first. 0 leaves FSDP2's implicit order. The root, embedding and head are never in the lists: they are
    gathered once each way, around the blocks."""
    for index, block in enumerate(blocks):
        if forward:
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + forward])
        if backward:
            block.set_modules_to_backward_prefetch(blocks[max(index - backward, 0):index][::-1])


def frozen_unshardable(module: nn.Module, mesh) -> set[nn.Parameter]:
    """Frozen tensors with an all-gather of their own (torchao's NF4) that FSDP2 cannot gather over a shard group of
    one device (its single-device shortcut copies one tensor per parameter): with NO_SHARD they stay outside FSDP,
    whole on every device, as NO_SHARD would hold them anyway."""
    if mesh.shape[-1] > 1:
        return set()
    return {p for p in module.parameters() if not p.requires_grad and hasattr(p, "fsdp_pre_all_gather")}
