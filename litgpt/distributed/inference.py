"""Generation on a model split by tensor parallelism (`litgpt generate` and `litgpt serve` with --parallel.tensor N):
the checks made before any process starts, Fabric for the N processes (started as the training commands start theirs:
Fabric's launcher with --devices N, torchrun or srun), and each rank's share of the model read from the checkpoint
folder: built on the meta device, split by generation's plan (no sequence parallelism), each tensor's piece read out
of the memory-mapped lit_model.pth. No process holds the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from litgpt.args import FSDPArgs, ParallelArgs
from litgpt.config import Config
from litgpt.distributed.plans import check_tensor_parallel
from litgpt.errors import UserError

# The -true precision of each dtype generation stores its weights in.
TRUE_PRECISIONS = {torch.float32: "32-true", torch.float16: "16-true", torch.bfloat16: "bf16-true"}


def split_devices(command: str, parallel: ParallelArgs, devices: Optional[int]) -> int:
    """The processes of a generation command (`command`: generate or serve) split by --parallel.tensor: one
    tensor-parallel group, so --devices (default: the degree) must be the degree; UserError otherwise."""
    tensor = parallel.tensor
    if parallel.expert > 1 or parallel.context > 1:
        raise UserError(f"litgpt {command} splits a model with --parallel.tensor only; --parallel.expert and "
                        "--parallel.context are for training: leave them out.")
    devices = tensor if devices is None else devices
    if devices < 1:
        raise UserError(f"--devices must be >= 1, got {devices}.")
    if tensor > devices:
        raise UserError(f"--parallel.tensor {tensor} splits the model over {tensor} devices, but --devices is "
                        f"{devices}: use --devices {tensor}.")
    if devices > tensor:
        raise UserError(f"--devices {devices} with --parallel.tensor {tensor}: litgpt {command} runs one copy of the "
                        f"model, split over --parallel.tensor devices: add --parallel.tensor {devices} to split it "
                        f"over {devices}, or use --devices {tensor}.")
    return devices


def check_split_generation(config: Config, tensor: int, device: str, quantize: Optional[str], compile: bool) -> None:
    """UserError for a split the machine, the model or the other options cannot have: more devices than this machine
    has, a model the plan does not cover or whose sizes the degree does not divide, quantized weights (not split by
    the plan), a compiled step, one named device (each process takes its own)."""
    if quantize is not None:
        raise UserError(f"--quantize {quantize} with --parallel.tensor {tensor} is not supported: the plan does not "
                        "split quantized weights; use one of the two.")
    if compile:
        raise UserError(f"--compile with --parallel.tensor {tensor} is not supported yet: leave --compile out.")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device} with --parallel.tensor {tensor}: each process takes a device of its own; "
                        "use --device auto, cuda or cpu.")
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    available = torch.cuda.device_count() if on_gpu else os.cpu_count() or 1
    if tensor > available:
        kind = "GPUs" if on_gpu else "CPU cores"
        raise UserError(f"--parallel.tensor {tensor} needs {tensor} devices, and this machine has {available} {kind}: "
                        "use at most that many.")
    check_tensor_parallel(config, tensor)


def split_fabric(tensor: int, device: str, dtype: torch.dtype):
    """Fabric for `tensor` processes on this machine, their mesh one tensor-parallel group (`strategy.tensor_mesh`)."""
    from litgpt.distributed.fabric import build_fabric

    return build_fabric(tensor, 1, TRUE_PRECISIONS[dtype], accelerator=device,
                        fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"), tensor=tensor)


def load_split_model(checkpoint_dir: Path, dtype: torch.dtype, mesh, device: torch.device):
    """This rank's share of the checkpoint's model in `dtype` on `device`, in eval mode: its heads, MLP columns and
    vocabulary rows over the 1-D tensor-parallel `mesh` (`apply_tensor_parallel` without sequence parallelism), the
    norms whole."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE, copy_weights, meta_device, read_model_weights
    from litgpt.distributed.parallelize import materialize_meta_tensors
    from litgpt.distributed.tensor_parallel import apply_tensor_parallel, row_orders
    from litgpt.model import GPT

    with meta_device():
        model = GPT(Config.from_checkpoint(checkpoint_dir))
    model.to(dtype)
    apply_tensor_parallel(model, mesh, sequence_parallel=False)
    materialize_meta_tensors(model, device)
    weights = checkpoint_dir / WEIGHTS_FILE
    copy_weights(model, read_model_weights(weights), str(weights), row_orders=row_orders(model))
    model.eval()
    model.requires_grad_(False)
    return model
