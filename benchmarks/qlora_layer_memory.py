"""What one 4-bit base layer's forward and backward passes hold beyond its weight, input and output: litgpt's layers
(`litgpt/sliced_linear.py`: the weight dequantized a slice at a time) against the libraries' own linear functions
(torchao's `linear_nf4`, bitsandbytes' `Linear4bit`), which dequantize it whole, for MLP weights of Llama 3.1 8B and
70B, beside what `litgpt plan` counts for the backward pass (`dequantize_bytes`).

Each measurement runs in a fresh process: quantize a random bf16 weight, make the input, then the forward pass, then
the backward pass of a sum of the outputs. On the CPU the figure is the rise of the process's peak RSS (VmHWM, reset
before each pass; malloc made to hand freed memory back, so RSS follows the tensors) over what it held before the
pass, less the pass's output (the layer's output, the input's gradient); on CUDA the same from
`torch.cuda.max_memory_allocated`. The time of each pass is printed too.

    python benchmarks/qlora_layer_memory.py                          # CPU, 256 positions
    python benchmarks/qlora_layer_memory.py --device cuda --tokens 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from chunked_loss_memory import MALLOC_RETURNS_FREED_MEMORY, status_bytes

MiB = 2**20
SHAPES = {"Llama-3.1-8B MLP": (14336, 4096), "Llama-3.1-70B MLP": (28672, 8192)}
FORMATS = ("ao.nf4", "bnb.nf4")
PATHS = ("litgpt", "library")


class Peak:
    """The peak bytes a block of work adds: VmHWM on the CPU, the allocator's peak on CUDA."""

    def __init__(self, device: str) -> None:
        self.device = device

    def now(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return status_bytes("VmRSS")

    def reset(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def peak(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return status_bytes("VmHWM")


def layer_function(fmt: str, path: str, weight, device: str):
    """The layer as x -> y: litgpt's or the library's own."""
    import torch
    import torch.nn.functional as F

    from litgpt.nf4 import linear_of_rows
    from litgpt.quantize import frozen_nf4, quantized_linear

    if fmt == "ao.nf4":
        nf4 = frozen_nf4(weight, weight.dtype)
        if path == "litgpt":
            return lambda x: linear_of_rows(x, nf4, None, nf4.shape[0])
        return lambda x: F.linear(x, nf4)
    import bitsandbytes as bnb

    layer = quantized_linear(weight, None, fmt, torch.device(device))
    return layer if path == "litgpt" else (lambda x: bnb.nn.Linear4bit.forward(layer, x))


def worker(args) -> dict:
    import gc

    import torch

    torch.manual_seed(0)
    rows, columns = args.shape
    meter = Peak(args.device)
    function = layer_function(args.format, args.path,
                              torch.randn(rows, columns, dtype=torch.bfloat16, device=args.device), args.device)
    gc.collect()
    x = torch.randn(args.tokens, columns, dtype=torch.bfloat16, device=args.device, requires_grad=True)
    result = {}
    before = meter.now()
    meter.reset()
    start = time.perf_counter()
    y = function(x)
    result["forward_seconds"] = time.perf_counter() - start
    result["forward_bytes"] = meter.peak() - before - y.numel() * y.element_size()
    grad = torch.ones_like(y)
    before = meter.now()
    meter.reset()
    start = time.perf_counter()
    (grad_x,) = torch.autograd.grad(y, x, grad)
    result["backward_seconds"] = time.perf_counter() - start
    result["backward_bytes"] = meter.peak() - before - grad_x.numel() * grad_x.element_size()
    return result


def measure(shape, fmt: str, path: str, args) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_RETURNS_FREED_MEMORY}
    argv = [sys.executable, __file__, "--worker", "--format", fmt, "--path", path, "--device", args.device,
            "--tokens", str(args.tokens), "--rows", str(shape[0]), "--columns", str(shape[1])]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{fmt} {path} {shape} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, default=256, help="positions of the input (the dequantization does not "
                                                                "depend on them)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--columns", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.shape = (args.rows, args.columns)
        print(json.dumps(worker(args)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from litgpt.plan.quantized import dequantize_bytes

    rows, load_before = [], os.getloadavg()
    print(f"{args.device}, bf16, {args.tokens} positions; MiB held beyond the weight, input and output; seconds")
    print(f"{'weight':20} {'format':8} {'path':8} {'forward':>9} {'backward':>9} {'planned':>9} {'fwd s':>7} {'bwd s':>7}")
    for name, shape in SHAPES.items():
        for fmt in FORMATS:
            planned = dequantize_bytes(shape, fmt, 2, 2)
            for path in PATHS:
                result = measure(shape, fmt, path, args)
                rows.append({"weight": name, "shape": shape, "format": fmt, "path": path, **result,
                             "planned_backward_bytes": planned if path == "litgpt" else None})
                print(f"{name:20} {fmt:8} {path:8} {result['forward_bytes'] / MiB:9.1f} "
                      f"{result['backward_bytes'] / MiB:9.1f} "
                      f"{planned / MiB if path == 'litgpt' else float('nan'):9.1f} "
                      f"{result['forward_seconds']:7.2f} {result['backward_seconds']:7.2f}", flush=True)
    if args.json:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown")
        args.json.write_text(json.dumps({"device": args.device, "cpu": cpu, "cores": os.cpu_count(),
                                         "load_before": load_before, "load_after": os.getloadavg(),
                                         "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
