"""The one place that knows about devices: building Fabric, activation checkpointing and compilation.

Entry points ask `build_fabric` for their Fabric; the model file stays free of device and parallelism code.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Union

import torch
from torch.utils.checkpoint import checkpoint

from litgpt.errors import UserError

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")

# Precision names accepted by --precision (Lightning's spellings and plain dtype names). Inference keeps no master
# weights, so the "-mixed" variants run in the same dtype as their "-true" counterparts.
PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "32": torch.float32,
    "float32": torch.float32,
    "16-true": torch.float16,
    "16-mixed": torch.float16,
    "16": torch.float16,
    "float16": torch.float16,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def default_precision() -> str:
    """bf16-mixed where the hardware supports it, else 32-true."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True  # not Linux: nothing to say
    return "avx512_bf16" in flags or "amx_bf16" in flags


def build_fabric(
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    precision: Optional[str] = None,
    loggers: Optional[list] = None,
    accelerator: str = "auto",
):
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    precision = precision or default_precision()
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if accelerator == "auto" and not torch.cuda.is_available() and precision == "16-mixed":
        raise UserError("--precision 16-mixed needs a GPU; on the CPU use bf16-mixed or 32-true.")
    if isinstance(devices, int) and devices < 1:
        raise UserError(f"--devices must be at least 1 (or 'auto'), got {devices}.")
    if num_nodes < 1:
        raise UserError(f"--num_nodes must be at least 1, got {num_nodes}.")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and isinstance(devices, int) and devices > (os.cpu_count() or 1):
        raise UserError(
            f"--devices {devices} asks for more CPU processes than this machine has cores ({os.cpu_count()}): "
            "use at most that many."
        )
    if precision.startswith("bf16") and not torch.cuda.is_available() and not cpu_has_fast_bf16():
        print(
            f"Warning: --precision {precision} on a CPU without native bf16 matrix multiply (AVX512-BF16 or AMX) "
            "runs many times slower than 32-true.",
            file=sys.stderr,
        )
    try:
        return Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision, loggers=loggers)
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as error:
        # Lightning's own checks (e.g. more devices than exist) come as exceptions with a readable message.
        raise UserError(f"Cannot set up the devices: {str(error).strip().splitlines()[0]}") from None


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every transformer block's activations during the backward pass instead of storing them."""
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
