"""The one place that knows about devices: Fabric, the FSDP strategy and its mesh, activation checkpointing.

Entry points ask `build_fabric` for their Fabric; the model file stays free of device and parallelism code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Union, get_args

import torch
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.utils.checkpoint import checkpoint

from litgpt.args import FSDPArgs, ShardingStrategy
from litgpt.errors import UserError
from litgpt.precision import PRECISION_DTYPES, check_precision, cpu_has_fast_bf16, default_precision
from litgpt.ranks import launcher_rank

SHARDING_STRATEGIES = get_args(ShardingStrategy)


def build_fabric(
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    precision: Optional[str] = None,
    loggers: Optional[list] = None,
    accelerator: str = "auto",
    fsdp: Optional[FSDPArgs] = None,
    strategy_for_world: Optional[Callable[[int], object]] = None,
):
    """Fabric for a run: one device, or FSDP2 (`FSDPStrategy`) when devices x num_nodes > 1.

    `strategy_for_world(world_size)`, when given, returns the Fabric strategy instead (extensions/thunder's).
    """
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    precision = precision or default_precision()
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    check_precision(precision, on_cpu)
    if num_nodes < 1:
        raise UserError(f"--num_nodes must be at least 1, got {num_nodes}.")
    devices = resolve_devices(devices, on_cpu)
    if on_cpu and devices > (os.cpu_count() or 1):
        raise UserError(
            f"--devices {devices} asks for more CPU processes than this machine has cores ({os.cpu_count()}): "
            "use at most that many."
        )
    if precision.startswith("bf16") and on_cpu and not cpu_has_fast_bf16():
        say_once(
            f"Warning: --precision {precision} on a CPU without native bf16 matrix multiply (AVX512-BF16 or AMX) "
            "runs many times slower than 32-true."
        )
    check_launcher(devices, num_nodes, os.environ)
    strategy = "auto"
    if strategy_for_world is not None:
        strategy = strategy_for_world(devices * num_nodes)
    elif devices * num_nodes > 1:
        fsdp = fsdp or FSDPArgs()
        topology = Topology(devices, num_nodes, fsdp.sharding_strategy)
        check_precision(precision, on_cpu, fsdp=True)
        strategy = FSDPStrategy(topology, fsdp, precision)
    try:
        return Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, loggers=loggers,
            strategy=strategy,
        )
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as error:
        # Lightning's own checks (e.g. more devices than exist) come as exceptions with a readable message.
        raise UserError(f"Cannot set up the devices: {' '.join(str(error).split())}") from None


def resolve_devices(devices: Union[int, str], on_cpu: bool) -> int:
    """--devices as a number: "auto" is what the launcher started per node, else every GPU (one process on a CPU)."""
    if devices == "auto":
        if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
            return int(os.environ["LOCAL_WORLD_SIZE"])
        if "SLURM_NTASKS" in os.environ and slurm_tasks_per_node(os.environ):
            return slurm_tasks_per_node(os.environ)
        return 1 if on_cpu else torch.cuda.device_count()
    try:
        count = int(devices)
    except (TypeError, ValueError):
        raise UserError(f"--devices must be a number or 'auto', got {devices!r}.") from None
    if count < 1:
        raise UserError(f"--devices must be at least 1 (or 'auto'), got {devices}.")
    return count


def say_once(text: str) -> None:
    """Print to stderr from the first process only (every process of a run executes the command's setup)."""
    if launcher_rank() == 0:
        print(text, file=sys.stderr)


# ---- topology ----------------------------------------------------------------------------------------------------------
def slurm_tasks_per_node(environ) -> Optional[int]:
    """Tasks per node of a Slurm step, if every node runs the same number (SLURM_TASKS_PER_NODE reads like "2(x4)")."""
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return int(environ["SLURM_NTASKS_PER_NODE"])
    counts = {int(part.split("(")[0]) for part in environ.get("SLURM_TASKS_PER_NODE", "").split(",") if part}
    return counts.pop() if len(counts) == 1 else None


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
            say_once("Note: HYBRID_SHARD replicates across nodes and shards within one; on one node it is FULL_SHARD.")
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
        from torch.distributed.device_mesh import init_device_mesh

        import torch.distributed as dist

        if dist.get_world_size() != self.world_size:
            raise UserError(
                f"{dist.get_world_size()} processes joined the run, but --devices {self.devices} x --num_nodes "
                f"{self.num_nodes} makes {self.world_size}."
            )
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))


def check_launcher(devices: int, num_nodes: int, environ) -> None:
    """Stop with one message when the processes a launcher starts do not match --devices and --num_nodes.

    A mismatch would otherwise hang at the first collective, waiting for processes that never come.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    # Lightning's hint to use srun whenever srun exists is noise on a cluster's login or batch node.
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
    world_size = devices * num_nodes
    asked = f"--devices {devices} --num_nodes {num_nodes} asks for {world_size} process(es)"
    if SLURMEnvironment.detect():  # Fabric looks for Slurm first, so do we
        tasks, per_node = int(environ["SLURM_NTASKS"]), slurm_tasks_per_node(environ)
        if tasks > 1 and "SLURM_STEP_ID" not in environ:
            raise UserError(
                f"This Slurm job has {tasks} tasks, but the command runs in the batch script itself, as one process "
                "that would wait for the others: start it with srun (`srun litgpt ...`), which starts one per task."
            )
        if tasks != world_size or per_node != devices:
            raise UserError(
                f"Slurm started {tasks} task(s) ({per_node or 'an uneven number'} per node), but {asked} "
                f"({devices} per node): run `srun --nodes {num_nodes} --ntasks-per-node {devices}` "
                "(#SBATCH --nodes / --ntasks-per-node), or change --devices and --num_nodes to match."
            )
        # `srun --ntasks N` leaves this unset and Fabric would refuse; the count is known to be uniform here.
        os.environ["SLURM_NTASKS_PER_NODE"] = str(per_node)
    elif TorchElasticEnvironment.detect():
        world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
        if world != world_size or local != devices:
            raise UserError(
                f"torchrun started {world} process(es) ({local} per node), but {asked} ({devices} per node): "
                f"use torchrun --nproc_per_node {devices} --nnodes {num_nodes}, or change --devices "
                "and --num_nodes to match."
            )
    elif num_nodes > 1 and "NODE_RANK" not in environ:
        raise UserError(
            f"--num_nodes {num_nodes} needs a launcher that starts the processes on every node: srun "
            f"(Slurm), torchrun --nnodes {num_nodes} --node_rank R --master_addr HOST, or this command on "
            "each node with NODE_RANK, MASTER_ADDR and MASTER_PORT set."
        )


# ---- the FSDP strategy -------------------------------------------------------------------------------------------------
class FSDPStrategy(ModelParallelStrategy):
    """Fabric's model-parallel strategy with FSDP2: `fully_shard` on each Block, then on the root, over our mesh.

    Built on `torch.distributed.fsdp.fully_shard` (not Lightning's FSDP1 strategy), so it runs on CPU with gloo as
    well as on CUDA with NCCL.
    """

    def __init__(self, topology: Topology, fsdp: FSDPArgs, precision: str) -> None:
        # Checkpoints are written by litgpt.checkpoint (full or sharded), not through Fabric's save/load.
        super().__init__(parallelize_fn=self._parallelize, timeout=timedelta(seconds=fsdp.timeout))
        self.topology = topology
        self.fsdp = fsdp
        self.training_precision = precision
        if topology.mesh_shape[1] > 1:
            # Skipping the gradient sync during accumulation would hold every gradient unsharded until the last
            # micro-batch: the memory FSDP exists to save. Sharded strategies reduce-scatter after every micro-batch.
            self._backward_sync_control = _ReduceEveryMicroBatch()

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not the parent's (data, tensor) mesh: ours is (replicate, shard)
        self._setup_distributed()
        self._device_mesh = self.topology.device_mesh(self.root_device.type)

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = RankLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @property
    def distributed_sampler_kwargs(self) -> dict:  # the parent reads a "data_parallel" mesh dimension we do not have
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _parallelize(self, module: nn.Module, mesh) -> nn.Module:
        # `prepare_model` shards before materializing; a model handed to `fabric.setup` unsharded is sharded here.
        if not is_sharded(module):
            shard_model(module, mesh, self.fsdp, self.training_precision, self.root_device)
        return module


class RankLauncher(_SubprocessScriptLauncher):
    """Fabric's launcher of ranks 1.. as child processes, with a patient watcher (`watch_ranks`) instead of one that
    SIGKILLs rank 0 the moment a child fails, before rank 0 can print why it stops and exit with code 1."""

    def launch(self, function: Callable, *args, **kwargs):
        from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._call_children_scripts()
        threading.Thread(target=watch_ranks, args=(self.procs,), daemon=True, name="litgpt-rank-watcher").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def watch_ranks(children: list, grace_seconds: float = 10.0) -> None:
    """Once a child rank has failed, give this process and the other children `grace_seconds` to stop by themselves
    (a collective fails at once when a peer is gone); then SIGKILL what is left, so that no rank outlives the run."""
    while not any(child.poll() for child in children):
        if all(child.returncode == 0 for child in children):
            return
        time.sleep(1.0)
    time.sleep(grace_seconds)
    for child in children:
        if child.poll() is None:
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


class _ReduceEveryMicroBatch(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        return contextlib.nullcontext()


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_model(model: nn.Module, mesh, fsdp: FSDPArgs, precision: str, device: torch.device) -> None:
    """FSDP2 over each transformer Block (the wrap unit), then the root: embeddings, final norm and head."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mixed = {"bf16-mixed": torch.bfloat16}.get(precision)
    # bf16 compute and all-gathers; gradients are reduced and kept in float32 with the float32 master weights.
    mp_policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32 if mixed else None)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    # SHARD_GRAD_OP keeps a block's parameters gathered from its forward to its backward.
    reshard = fsdp.sharding_strategy != "SHARD_GRAD_OP"
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
    # The root's parameters (embeddings, final norm, head) stay gathered: the backward pass begins with the head.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)


def prepare_model(
    fabric,
    model: nn.Module,
    precision: str,
    initialize: Callable[[nn.Module], None],
    activation_checkpointing: bool,
    compile_blocks: bool = False,
) -> nn.Module:
    """Take a model built on the meta device to `fabric.device`, in the fixed order: dtype, activation checkpointing,
    compilation (`compile_blocks`), sharding, then materialization and initialization (`initialize`), so no process
    ever holds the full model.

    Initialization is rank-aware: a sharded model gets the same weights as a single-process model from the same seed.
    """
    if precision in ("bf16-true", "16-true"):
        model.to(PRECISION_DTYPES[precision])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_blocks:
        compile_each_block(model)
    strategy = fabric.strategy
    if isinstance(strategy, FSDPStrategy):
        shard_model(model, strategy.device_mesh, strategy.fsdp, precision, fabric.device)
    model.to_empty(device=fabric.device)
    with torch.no_grad(), FullTensorInit():
        initialize(model)
    return model


class FullTensorInit(torch.overrides.TorchFunctionMode):
    """Random initializers on a sharded tensor (DTensor) draw the full tensor, as one process would, and keep this
    rank's piece: the same weights for any world size, from the same seed."""

    RANDOM_INIT = {
        torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
        # nn.init's functions are override points of their own (called with `tensor=`); inside one the mode is off.
        nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
        nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.orthogonal_,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func in self.RANDOM_INIT and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            if args:
                func(full, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": full})
            copy_into_shard(target, full)
            return target
        return func(*args, **kwargs)


def copy_into_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the piece of `full` (e.g. a memory-mapped checkpoint tensor) that this rank holds of `target`.

    Only that piece is read, so loading a full checkpoint into a sharded model never holds the whole model.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(full)
            return
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        piece = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
        target.to_local().copy_(piece)


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (every rank must call this; collective for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compile_each_block(model: torch.nn.Module) -> None:
    """`torch.compile` every transformer block in place (`--compiler torch`): after activation checkpointing and
    before sharding, torchtitan's order, so each graph is one block with its recomputation and FSDP's hooks stay
    around it; compiled in place, the blocks keep their parameter names."""
    for block in model.transformer.h:
        block.compile()


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every transformer block's activations during the backward pass instead of storing them."""
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
