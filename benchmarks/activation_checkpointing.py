"""Memory and speed of each `--train.activation_checkpointing` setting, on the CPU.

    python benchmarks/activation_checkpointing.py                   # n_embd 512, 8 layers, seq 512, batch 4
    python benchmarks/activation_checkpointing.py --modes none ops full --steps 5 --output results/ac.json

Each setting trains a Llama-shaped model (float32, AdamW) in a fresh child process whose malloc hands freed memory
straight back to the OS (the glibc tunables tests/test_plan.py measures with), so its resident set follows the
tensors. After one warm-up step (the optimizer state then exists) the child resets its high-water mark and takes the
timed steps. The table gives, per setting: the activations `litgpt plan` counts for the run (the fake-tensor
measurement that tests/test_activation_checkpointing.py checks against the real forward pass to the byte), the peak
resident memory the timed steps add to what the process holds between steps (activations, gradients, logits and
loss, work buffers), and the median step's CPU time (the process's, one thread by default: on a shared host it
follows the work done where wall time follows the neighbours; wall time beside it), of the run with the least of
`--repeats` runs taken in turn; each beside the run without checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("none", "every:4", "every:2", "ops", "full")
MALLOC_RETURNS_FREED_MEMORY = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"


def model_config(args: argparse.Namespace) -> dict:
    return dict(
        name=f"ac-bench-{args.width}x{args.layers}", n_layer=args.layers, n_embd=args.width,
        n_head=args.width // 64, n_query_groups=max(args.width // 256, 1), intermediate_size=args.width * 8 // 3,
        vocab_size=args.vocab, padded_vocab_size=args.vocab, block_size=args.seq, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(mode: str, args: argparse.Namespace) -> dict:
    """One setting: the planned activations, the timed steps' peak above the resident state, and the step times."""
    import torch

    from litgpt.config import Config
    from litgpt.distributed.parallelize import apply_activation_checkpointing
    from litgpt.model import GPT
    from litgpt.args import TrainArgs
    from litgpt.plan import plan_for
    from litgpt.train.loss import cross_entropy
    from litgpt.train.optimizer import build_optimizer

    torch.set_num_threads(args.threads)
    config = Config(**model_config(args))
    train = TrainArgs(micro_batch_size=args.batch, max_seq_length=args.seq, activation_checkpointing=mode)
    plan = plan_for(config, precision="32-true", train=train, device="cpu", accumulate_gradients=False)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    apply_activation_checkpointing(model, mode)
    optimizer = build_optimizer("AdamW", model.parameters(), torch.device("cpu"))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = cross_entropy(model(x), y)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - start_cpu

    step()  # warm-up: kernels, autograd's threads, the optimizer state
    between_steps = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    times = [step() for _ in range(args.steps)]
    return dict(mode=mode, planned_activations=plan.activations, step_peak=status_bytes("VmHWM") - between_steps,
                step_s=statistics.median(wall for wall, _ in times), step_cpu_s=statistics.median(c for _, c in times))


def run_child(mode: str, argv: list[str]) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_RETURNS_FREED_MEMORY}
    result = subprocess.run([sys.executable, __file__, "--child", mode, *argv], capture_output=True, text=True,
                            env=env, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{mode}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = next((row for row in rows if row["mode"] == "none"), rows[0])
    mib = 2**20
    lines = [
        f"{'setting':9} {'activations (plan)':>19} {'step peak RSS':>14} {'step CPU time':>14} {'wall':>7}  "
        f"vs {base['mode']}: activations, peak, CPU time",
    ]
    for row in rows:
        lines.append(
            f"{row['mode']:9} {row['planned_activations'] / mib:15,.1f} MiB {row['step_peak'] / mib:10,.1f} MiB "
            f"{row['step_cpu_s']:13.2f}s {row['step_s']:6.2f}s  "
            f"{row['planned_activations'] / base['planned_activations']:9.2f}x "
            f"{row['step_peak'] / base['step_peak']:5.2f}x {row['step_cpu_s'] / base['step_cpu_s']:5.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), help="settings as --train.activation_checkpointing")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every setting, taken in turn; the run with the least CPU time counts")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    from litgpt.args import ActivationCheckpointing

    modes = [str(ActivationCheckpointing.parse(mode, "--modes")) for mode in args.modes]  # a typo fails here
    shape = [f"--{name}={getattr(args, name)}" for name in ("layers", "width", "seq", "batch", "vocab", "steps",
                                                             "threads")]
    print(f"Llama-shaped {model_config(args)['name']}, vocab {args.vocab}, micro batch {args.batch} x {args.seq}, "
          f"float32, AdamW, {args.threads} thread(s), median of {args.steps} steps, best of {args.repeats} runs")
    runs = [run_child(mode, shape) for _ in range(args.repeats) for mode in modes]
    rows = [min((run for run in runs if run["mode"] == mode), key=lambda run: run["step_cpu_s"]) for mode in modes]
    print(table(rows))
    if args.output:
        args.output.write_text(json.dumps(dict(arguments=vars(args) | {"output": str(args.output)}, rows=rows),
                                          indent=2) + "\n")


if __name__ == "__main__":
    main()
