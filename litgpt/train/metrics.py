"""What a run measures of itself: throughput, model FLOPs and MFU against the device's peak, peak memory."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Optional

import torch

from litgpt.caches import cache_dir
from litgpt.checkpoint.model_files import meta_device
from litgpt.config import Config
from litgpt.distributed.runtime import every_rank
from litgpt.io import write_json
from litgpt.model import GPT
from litgpt.precision import Precision


class LogWindow:
    """The steps since the last log line: their summed losses (the loss and its parts, `loss_names`), label tokens,
    time in steps, tokens trained."""

    def __init__(self, device: torch.device, tokens: int) -> None:
        self.device = device
        self.loss_names = ["loss"]  # the loss function's, from the first update on
        self.losses = torch.zeros(1, device=device)
        self.label_tokens = torch.zeros((), device=device, dtype=torch.long)
        self.lr = 0.0
        self.reset(tokens)

    def reset(self, tokens: int) -> None:
        self.losses.zero_()
        self.label_tokens.zero_()
        self.steps, self.updates, self.seconds, self.start_tokens = 0, 0, 0.0, tokens

    def add_update(self, step_losses: dict[str, torch.Tensor]) -> None:
        """A step whose update was applied (not skipped for a non-finite value), its losses by name."""
        if list(step_losses) != self.loss_names:
            self.loss_names, self.losses = list(step_losses), torch.zeros(len(step_losses), device=self.device)
        self.losses += torch.stack(list(step_losses.values()))
        self.updates += 1

    def add_step(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds  # seconds in steps, not in validation or saving

    def metrics(self, fabric, tokens: int, epoch: int) -> dict:
        """The window's mean loss and its parts over the ranks (NaN when every step was skipped), throughput and peak
        memory."""
        if self.updates:
            values = (fabric.all_reduce(self.losses, reduce_op="mean") / self.updates).tolist()
        else:
            values = [float("nan")] * len(self.loss_names)  # every step of the window skipped: not finite
        return {
            **dict(zip(self.loss_names, values)), "lr": self.lr, "tokens": tokens, "epoch": epoch,
            "tokens_per_sec": (tokens - self.start_tokens) / self.seconds,
            "peak_memory_mb": peak_memory_bytes(fabric.device) / 2**20,
        }


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def flops_per_token(config: Config, seq_length: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token as PaLM counts them: 6N (forward + backward) plus the attention scores term.

    With frozen weights (LoRA) the weight-gradient third of the backward is skipped for them.
    """
    n = sum(p.numel() for name, p in _parameter_shapes(config) if "wte" not in name)
    matmul = 2 * n * (2 + trainable_fraction)
    attention = 12 * config.n_layer * config.n_head * config.head_size * seq_length
    return matmul + attention


def _parameter_shapes(config: Config):
    with meta_device():
        return list(GPT(config).named_parameters())


def per_rank_peak_memory_mb(fabric) -> list[float]:
    """Every rank's peak memory (collective): a sharded run should show each rank holding its part only."""
    return every_rank(round(peak_memory_bytes(fabric.device) / 2**20, 1))


# Dense bf16 peak FLOP/s of the GPUs we quote MFU for.
GPU_PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048,
                          seconds: float = 0.5) -> tuple[float, int]:
    """The FLOP/s a large square matmul reaches on `device` (the hardware limit that MFU is measured against), and
    the side of the matrices it was measured with.

    The side doubles from 256 up to `size` while the next one would still take under `seconds` per matmul: a dtype
    the device only emulates (bf16 on a CPU without AVX512-BF16 or AMX, where one 2048^3 matmul takes about a minute)
    is measured at a smaller size instead of stalling the end of the run for minutes.
    """

    def matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    side = 256
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        matmul_seconds(a, b)  # warm-up: library initialization and kernel selection
        if side >= size or 8 * matmul_seconds(a, b) > seconds:
            break
        side *= 2
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < seconds:
        matmul_seconds(a, b)
        runs += 1
    return 2 * side**3 * runs / (time.perf_counter() - start), side


PEAKS_FILE = "matmul-peaks.json"


def matmul_peak(device: torch.device, dtype: torch.dtype, device_name: str) -> tuple[float, str]:
    """`measured_matmul_flops` of this device, dtype and thread count, measured once per machine and kept in the
    cache folder (`$LITGPT_CACHE_DIR/matmul-peaks.json`): a hardware limit need not cost every run half a second of
    matmuls at its end. Returns the FLOP/s and where they come from."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = f"{device_name} | {dtype} | {threads} threads | torch {torch.__version__}"
    path = cache_dir() / PEAKS_FILE
    peaks = _read_peaks(path)
    if key not in peaks:
        flops, side = measured_matmul_flops(device, dtype)
        peaks[key] = {"flops": flops, "side": side}
        try:
            write_json(path, {**_read_peaks(path), key: peaks[key]})  # another run may have added its own since
        except OSError:  # a read-only home: measured again next time
            pass
    flops, side = peaks[key]["flops"], peaks[key]["side"]
    return flops, f"measured: {side}^3 {dtype} matmul on this device, kept in {path}"


def _read_peaks(path: Path) -> dict:
    """The cached peaks, without the entries that are not what `matmul_peak` writes (nothing, if the file is not
    JSON): those are measured again."""
    try:
        peaks = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(peaks, dict):
        return {}
    return {key: value for key, value in peaks.items()
            if isinstance(value, dict) and isinstance(value.get("flops"), float) and value["flops"] > 0
            and isinstance(value.get("side"), int)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def run_metrics(fabric, state, config: Config, precision: Precision, io, val_loss, seq_length: int,
                trainable_fraction: float, loss_parts: Optional[dict] = None) -> dict:
    """metrics.json: the run's totals, throughput, MFU against the device's peak, where it ran, and the parts of the
    training loss (kd_loss, ce_loss, aux_loss) as the last log line gave them: means over its window of steps."""
    tokens_per_sec = state.tokens / state.train_seconds if state.train_seconds else 0.0
    flops = flops_per_token(config, seq_length, trainable_fraction) * tokens_per_sec
    device = fabric.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    if device_name in GPU_PEAK_FLOPS:
        peak, source = GPU_PEAK_FLOPS[device_name], "datasheet, dense bf16"
    else:
        dtype = torch.float32 if precision.compute_dtype == torch.float32 else torch.bfloat16  # 16 bits: bf16's peak
        # Rank 0 alone measures (the ranks of a machine measuring at once would share its cores) and tells the others.
        measured = matmul_peak(device, dtype, device_name) if fabric.global_rank == 0 else None
        peak, source = fabric.broadcast(measured, src=0)
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "train_seconds": round(state.train_seconds, 3),
        "tokens_per_sec": round(tokens_per_sec, 1),
        "samples_per_sec": round(tokens_per_sec / seq_length, 3),
        "model_flops_per_sec": flops,
        "mfu": flops / (peak * fabric.world_size),
        "peak_flops_per_device": peak,
        "peak_flops_source": source,
        "val_loss": val_loss,
        "skipped_steps": state.skipped_steps,
        "world_size": fabric.world_size,
        "num_nodes": getattr(fabric.strategy, "num_nodes", 1),
        "cluster_environment": type(getattr(fabric.strategy, "cluster_environment", None)).__name__,
        "sharding_strategy": io.sharding_strategy,
        "state_dict_type": io.state_dict_type,
        "fsdp": io.options,
        "precision": precision.name,
        "device": device_name,
        "peak_memory_mb": round(peak_memory_bytes(device) / 2**20, 1),
        "peak_memory_mb_per_rank": per_rank_peak_memory_mb(fabric),
        **(loss_parts or {}),
    }
