"""Peak memory (and, on a GPU, step time) of one training step with the chunked output head + loss against the plain
loss on whole logits, for a model whose vocabulary dwarfs the rest (128k rows, n_embd 256, 2 layers).

Each setting runs in a fresh process: build the model and AdamW, then training steps (forward, backward, optimizer
step). The plain loss is the old path, `cross_entropy(model(x), y)` on whole logits upcast to float32; the chunked one
is what training runs (`litgpt.train.loss.loss_function`: `GPT(x, return_hidden=True)` and `chunked_head_loss`),
with the automatic chunk size and with any `--chunk` given. On the CPU the figure is the process's peak RSS (VmHWM)
and its rise over the built model, up to the end of the backward pass and over the whole step with AdamW's first
update (malloc made to hand freed memory back, so RSS follows the tensors); on CUDA `torch.cuda.max_memory_allocated`
and the median step time.

    python benchmarks/chunked_loss_memory.py                      # CPU, 32-true, batch 2 x 1024
    python benchmarks/chunked_loss_memory.py --device cuda --precision bf16-mixed --batch 4 --seq 4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 2**20
MALLOC_RETURNS_FREED_MEMORY = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args) -> dict:
    """One setting in this process: peak memory of the steps and their median time."""
    import torch

    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.train.loss import cross_entropy, loss_function

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = Config(name="vocab-128k", n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, n_query_groups=4,
                    vocab_size=args.vocab, padded_vocab_size=args.vocab, block_size=args.seq,
                    intermediate_size=4 * args.n_embd, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    if args.precision == "bf16-true":
        model.bfloat16()
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    if args.mode == "plain":
        loss_fn = lambda model, x, y: cross_entropy(model(x), y)  # noqa: E731 - the old path
    else:
        chunked = loss_function("cross_entropy", args.chunk[0] if args.chunk else None)  # the worker gets one
        loss_fn = lambda model, x, y: chunked(model, x, y)["loss"]  # noqa: E731 - the loss without its parts
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else None

    def peak_now() -> int:
        return torch.cuda.max_memory_allocated() if device.type == "cuda" else status_bytes("VmHWM")

    backward_peaks = []

    def step() -> float:
        with autocast or contextlib.nullcontext():  # the trainer runs its loss under the precision's autocast
            loss = loss_fn(model, x, y)
        loss.backward()
        backward_peaks.append(peak_now())  # forward and backward, before the optimizer's state and update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []
    if device.type == "cuda":
        step()  # warm-up: kernels, the optimizer's state
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = peak_now()
    return {"peak": peak, "rise": peak - before, "backward_rise": max(backward_peaks) - before,
            "step_s": sorted(times)[len(times) // 2], "loss": losses[0]}


def run_setting(mode: str, chunk, args) -> dict:
    argv = [sys.executable, __file__, "--worker", mode, "--device", args.device, "--precision", args.precision,
            "--vocab", str(args.vocab), "--n_embd", str(args.n_embd), "--n_layer", str(args.n_layer),
            "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
            "--threads", str(args.threads)]
    if chunk is not None:
        argv += ["--chunk", str(chunk)]
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_RETURNS_FREED_MEMORY}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "bf16-true"), default="32-true")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1, help="steps measured (CUDA: after one warm-up step)")
    parser.add_argument("--chunk", type=int, nargs="*", default=[], help="chunk sizes to run besides the automatic one")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.mode = args.worker
        print(json.dumps(worker(args)))
        return

    from litgpt.train.loss import auto_chunk_size

    auto = auto_chunk_size(args.batch * args.seq, args.n_embd, args.vocab)
    settings = [("plain (whole logits)", "plain", None), (f"chunked, automatic ({auto})", "chunked", None)]
    settings += [(f"chunked, --chunk {chunk}", "chunked", chunk) for chunk in args.chunk]
    print(f"{args.device}, {args.precision}: vocabulary {args.vocab:,}, n_embd {args.n_embd}, {args.n_layer} layers, "
          f"batch {args.batch} x {args.seq} tokens; whole float32 logits = "
          f"{args.batch * args.seq * args.vocab * 4 / MiB:,.0f} MiB")
    kind = "peak allocated" if args.device == "cuda" else "peak RSS"
    results = [(label, run_setting(mode, chunk, args)) for label, mode, chunk in settings]
    plain = results[0][1]
    for label, r in results:
        timing = f", step {r['step_s'] * 1000:,.1f} ms" if args.device == "cuda" else ""
        print(f"{label:28} {kind} {r['peak'] / MiB:7,.0f} MiB, ratio to plain {r['peak'] / plain['peak']:.2f} | rise "
              f"over the built model: forward+backward {r['backward_rise'] / MiB:7,.0f} MiB, whole step "
              f"{r['rise'] / MiB:7,.0f} MiB{timing} | loss {r['loss']:.5f}")


if __name__ == "__main__":
    main()
