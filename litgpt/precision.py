"""Precision: a training run's precision, resolved once by its entry point (the per-machine default included) and
handed as one value to Fabric, the recipe, the trainer, the planner and the metrics; nothing else parses a precision
string. Also the precision names and dtypes of inference, light to import (generation needs them without the training
stack)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from litgpt.errors import UserError

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "fp8-mixed")
# fp8-mixed's scaling recipes (torchao's names, `litgpt.distributed.float8`); the first is the default.
FLOAT8_RECIPES = ("rowwise", "tensorwise")

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
    "fp8-mixed": torch.bfloat16,  # what is not an fp8 matmul computes in bf16
}


@dataclass(frozen=True)
class Precision:
    """How a training run stores and computes: one of `PRECISIONS`, and why it was chosen (printed at start).

    "-mixed" keeps float32 weights (the optimizer's master copies) and computes in 16 bits under autocast; "-true"
    stores and computes in the one dtype. "fp8-mixed" is bf16-mixed whose trained blocks' linear layers multiply in
    float8 (torchao's float8 training with the scaling recipe `float8_recipe`: `litgpt.distributed.float8`).
    """

    name: str
    reason: str = "--precision"
    float8_recipe: str = FLOAT8_RECIPES[0]

    @classmethod
    def resolve(cls, requested: "Optional[str | Precision]", cpuinfo: Optional[str] = None,
                float8_recipe: Optional[str] = None) -> "Precision":
        """--precision as given (UserError for an unknown name), or this machine's default with its reason; with
        --train.float8_recipe `float8_recipe` (None: the default recipe), which only fp8-mixed takes."""
        if isinstance(requested, Precision):
            return requested
        if requested is None:
            name, reason = default_precision_and_reason(cpuinfo)
            precision = cls(name, f"the default here: {reason}; --precision to choose")
        elif requested not in PRECISIONS:
            raise UserError(f"--precision {requested!r} is not one of {', '.join(PRECISIONS)}.")
        else:
            precision = cls(requested)
        if float8_recipe is None:
            return precision
        if not precision.float8:
            raise UserError(f"--train.float8_recipe {float8_recipe} is a scaling recipe of --precision fp8-mixed; this "
                            f"run is {precision.name}: add --precision fp8-mixed or leave the recipe out.")
        if float8_recipe not in FLOAT8_RECIPES:
            raise UserError(f"--train.float8_recipe {float8_recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}.")
        return replace(precision, float8_recipe=float8_recipe)

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"{self.name!r} is not one of {PRECISIONS}")
        if self.float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"{self.float8_recipe!r} is not one of {FLOAT8_RECIPES}")

    def __str__(self) -> str:
        return self.name

    @property
    def is_default(self) -> bool:
        return self.reason != "--precision"

    @property
    def mixed(self) -> bool:
        """Float32 weights, 16-bit compute under autocast."""
        return self.name.endswith("-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix multiplies run in (and a frozen model, which needs no master weights, is stored in)."""
        return PRECISION_DTYPES[self.name]

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype trained weights are stored in: float32 under -mixed (master copies), else the compute dtype."""
        return torch.float32 if self.mixed else self.compute_dtype

    @property
    def float8(self) -> bool:
        """fp8-mixed: the blocks' linear layers multiply in float8, scaled by `float8_recipe`."""
        return self.name == "fp8-mixed"

    @property
    def autocast_name(self) -> str:
        """The Lightning precision whose autocast this one runs under (fp8-mixed: bf16-mixed around the fp8 matmuls)."""
        return "bf16-mixed" if self.float8 else self.name

    @property
    def scales_gradients(self) -> bool:
        """16-mixed: a gradient scaler skips the steps whose gradients overflow and lowers its scale by itself."""
        return self.name == "16-mixed"

    @property
    def sharded_compute_dtype(self) -> Optional[torch.dtype]:
        """FSDP2's all-gather and compute dtype (its `MixedPrecisionPolicy.param_dtype`): bf16 under bf16-mixed (and
        fp8-mixed, whose fp8 layers cast their bf16 inputs and weights themselves), None
        (the stored dtype) otherwise; gradients are then reduced in float32."""
        return torch.bfloat16 if self.autocast_name == "bf16-mixed" else None

    def check_devices(self, on_cpu: bool, sharded: bool) -> None:
        """UserError for a precision these devices cannot train in: 16-mixed on a CPU or under FSDP, fp8-mixed on a GPU
        without float8 matmuls (the CPU runs them, slowly: for checks)."""
        if on_cpu and self.name == "16-mixed":
            raise UserError("--precision 16-mixed needs a GPU; on the CPU use bf16-mixed or 32-true.")
        if sharded and self.name == "16-mixed":
            raise UserError("--precision 16-mixed is not supported with FSDP: use bf16-mixed (or 16-true).")
        if self.float8 and not on_cpu and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            raise UserError(f"--precision fp8-mixed needs a GPU that multiplies in float8 (compute capability 8.9 or "
                            f"newer: H100, L4, RTX 4090); this one is {major}.{minor}: use bf16-mixed.")


# Where the CPU's flags are read from; LITGPT_CPUINFO names another file of the same format (tests feed fixtures).
CPUINFO = "/proc/cpuinfo"
# CPU flags of native bf16 matrix multiply: AVX512-BF16 (dot products) or AMX (tiles).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpuinfo_path() -> str:
    """The cpuinfo file this process reads: $LITGPT_CPUINFO, else /proc/cpuinfo."""
    return os.environ.get("LITGPT_CPUINFO") or CPUINFO


def cpu_bf16_flags(cpuinfo: Optional[str] = None) -> Optional[list[str]]:
    """The native-bf16 flags (`NATIVE_BF16_FLAGS`) on the first `flags` line of `cpuinfo` (default `cpuinfo_path()`),
    [] when it has none, None when there is no such file or line (not Linux): what the CPU reports, no probe."""
    try:
        with open(cpuinfo or cpuinfo_path()) as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    if line is None:
        return None
    flags = set(line.partition(":")[2].split())
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def cpu_has_fast_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether the CPU reports native bf16 matrix multiply; True when it reports nothing (not Linux: no warning)."""
    flags = cpu_bf16_flags(cpuinfo)
    return flags is None or bool(flags)


def default_precision_and_reason(cpuinfo: Optional[str] = None) -> tuple[str, str]:
    """Training's default precision here and why: bf16-mixed on GPUs with bf16 (16-mixed on older ones) and on CPUs
    that report native bf16 (AVX512-BF16 or AMX; bf16 runs emulated and many times slower elsewhere), else 32-true."""
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "the GPU supports bf16"
        return "16-mixed", "the GPU has no bf16"
    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return "bf16-mixed", f"the CPU has native bf16 ({', '.join(flags)})"
    if flags is None:
        return "32-true", f"{cpuinfo or cpuinfo_path()} does not say whether the CPU has native bf16"
    return "32-true", "the CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"


def default_precision(cpuinfo: Optional[str] = None) -> str:
    """Training's default precision on this machine (`default_precision_and_reason`)."""
    return default_precision_and_reason(cpuinfo)[0]


def default_inference_dtype(device: torch.device, cpuinfo: Optional[str] = None) -> torch.dtype:
    """Generation's default dtype on `device`: bf16 on GPUs that support it (fp16 on others and on MPS), on the CPU
    bf16 where it is native (`cpu_bf16_flags`), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_bf16_flags(cpuinfo) else torch.float32


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `x` runs in: autocast's where autocast is on for x's device (CPU or CUDA), else x's own."""
    device = x.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype
