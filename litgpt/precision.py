"""Precision names and dtypes: light to import (generation needs them without the training stack)."""

from __future__ import annotations

import torch

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


def check_precision(precision: str, on_cpu: bool, fsdp: bool = False) -> None:
    """UserError for a training --precision that cannot run: unknown, 16-mixed on a CPU or (`fsdp`) sharded."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if on_cpu and precision == "16-mixed":
        raise UserError("--precision 16-mixed needs a GPU; on the CPU use bf16-mixed or 32-true.")
    if fsdp and precision == "16-mixed":
        raise UserError("--precision 16-mixed is not supported with FSDP: use bf16-mixed (or 16-true).")


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
