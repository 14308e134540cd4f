"""Fabric for a run, and the checks that the launcher (Fabric itself, torchrun, srun) started what the flags ask for.

Entry points ask `build_fabric` for their Fabric; a strategy other than FSDP2 (an extension's) comes in through
`strategy_for_world`.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Optional, Union

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
from lightning.fabric.plugins.precision import Precision as FullPrecision

from litgpt.args import FSDPArgs, ParallelArgs
from litgpt.distributed.fsdp import FSDPStrategy
from litgpt.distributed.topology import Topology
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.precision import Precision, cpu_has_fast_bf16


def build_fabric(
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    precision: Union[Precision, str, None] = None,
    loggers: Optional[list] = None,
    accelerator: str = "auto",
    fsdp: Optional[FSDPArgs] = None,
    strategy_for_world: Optional[Callable[[int], object]] = None,
    tensor: int = 1,
    expert: int = 1,
    context: int = 1,
    pipeline: Optional[ParallelArgs] = None,
):
    """Fabric for a run: one device, or FSDP2 (`FSDPStrategy`) when devices x num_nodes > 1, with `tensor`-way
    tensor parallelism inside each node, `expert`-way expert parallelism over the data-parallel ranks and
    `pipeline.pipeline`-way pipeline parallelism with its schedule (`Topology`).

    `precision` is the run's `Precision` (a name or None is resolved here, for callers outside training);
    `strategy_for_world(world_size)`, when given, returns the Fabric strategy instead (a compiler extension's).
    """
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    precision = Precision.resolve(precision)
    if precision.is_default:
        print_once(f"Precision: {precision} ({precision.reason})")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if num_nodes < 1:
        raise UserError(f"--num_nodes must be at least 1, got {num_nodes}.")
    devices = resolve_devices(devices, on_cpu)
    world_size = devices * num_nodes
    precision.check_devices(on_cpu, sharded=world_size > 1 and strategy_for_world is None)
    # Only where litgpt starts the processes itself: those srun or torchrun started exist already.
    if on_cpu and devices > (os.cpu_count() or 1) and not started_by_launcher():
        raise UserError(
            f"--devices {devices} asks for more CPU processes than this machine has cores ({os.cpu_count()}): "
            "use at most that many."
        )
    if precision.compute_dtype == torch.bfloat16 and on_cpu and not cpu_has_fast_bf16():
        print_once(
            f"Warning: --precision {precision} on a CPU without native bf16 matrix multiply (AVX512-BF16 or AMX) "
            "runs many times slower than 32-true.",
            file=sys.stderr,
        )
    check_launcher(devices, num_nodes, os.environ)
    if fsdp is not None and fsdp.cpu_offload and strategy_for_world is None and world_size == 1:
        raise UserError(
            "--fsdp.cpu_offload true moves FSDP's sharded state to CPU memory, but one device runs without FSDP: "
            "use it with devices x num_nodes > 1, or leave it out."
        )
    strategy = "auto"
    if strategy_for_world is not None:
        strategy = strategy_for_world(world_size)
    elif world_size > 1:
        fsdp = fsdp or FSDPArgs()
        stages = {} if pipeline is None else dict(pipeline=pipeline.pipeline, stages_per_rank=pipeline.stages_per_rank,
                                                  pipeline_schedule=pipeline.pipeline_schedule,
                                                  context_attention=pipeline.context_attention)
        topology = Topology(devices, num_nodes, fsdp.sharding_strategy, tensor, expert, context, **stages)
        strategy = FSDPStrategy(topology, fsdp)
    elif tensor > 1:
        raise UserError(f"--parallel.tensor {tensor} splits each layer over {tensor} devices, but the run has one: "
                        f"use --devices {tensor} (or a multiple of it).")
    elif expert > 1:
        raise UserError(f"--parallel.expert {expert} splits the experts over {expert} devices, but the run has one: "
                        f"use --devices {expert} (or a multiple of it).")
    elif context > 1:
        raise UserError(f"--parallel.context {context} splits each sequence over {context} devices, but the run has "
                        f"one: use --devices {context} (or a multiple of it).")
    elif pipeline is not None and pipeline.pipeline > 1:
        raise UserError(f"--parallel.pipeline {pipeline.pipeline} runs the model's stages on {pipeline.pipeline} "
                        f"devices, but the run has one: use --devices {pipeline.pipeline} (or a multiple of it).")
    try:
        return Fabric(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, loggers=loggers, strategy=strategy,
            plugins=[fabric_precision_plugin(precision, on_cpu)],
        )
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as error:
        # Lightning's own checks (e.g. more devices than exist) come as exceptions with a readable message.
        raise UserError(f"Cannot set up the devices: {' '.join(str(error).split())}") from None


class HalfPrecisionAsBuilt(HalfPrecision):
    """Lightning's -true plugin without its cast of the whole module in `fabric.setup`: the model is cast once,
    where `litgpt.distributed.parallelize` builds it (a QLoRA base keeps its quantized weights as they are)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


def fabric_precision_plugin(precision: Precision, on_cpu: bool):
    """Lightning's precision plugin for `precision` (autocast and a gradient scaler under -mixed)."""
    if precision.mixed:
        return MixedPrecision(precision.autocast_name, device="cpu" if on_cpu else "cuda")
    if precision.name == "32-true":
        return FullPrecision()
    return HalfPrecisionAsBuilt(precision.name)


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


def slurm_tasks_per_node(environ) -> Optional[int]:
    """Tasks per node of a Slurm step, if every node runs the same number (SLURM_TASKS_PER_NODE reads like "2(x4)")."""
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return int(environ["SLURM_NTASKS_PER_NODE"])
    counts = {int(part.split("(")[0]) for part in environ.get("SLURM_TASKS_PER_NODE", "").split(",") if part}
    return counts.pop() if len(counts) == 1 else None


def started_by_launcher() -> bool:
    """Whether srun or torchrun started this process and its peers (Fabric's launcher starts none then)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return SLURMEnvironment.detect() or TorchElasticEnvironment.detect()


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




