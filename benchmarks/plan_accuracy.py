"""`litgpt plan`'s peak against the peak a real `litgpt pretrain` run measures, setting by setting.

Each setting trains a few steps of the named model (random weights, the bundled tiny data) in a fresh process and
reads the run's own `peak_memory_mb` from `metrics.json` (`torch.cuda.max_memory_allocated` on CUDA); the planner
is asked for the same run. Prints both and the ratio. Meant for a GPU (`--device cuda`); on a CPU the measured
figure is the process's peak RSS, which also counts the Python runtime and libraries, so use the planner's tests
(`tests/test_plan.py`) there instead.

    python benchmarks/plan_accuracy.py --model Llama-3.2-1B --seq_length 2048 --micro_batch_size 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from litgpt.data.tiny import TOKENIZER_DIR  # the bundled tiny tokenizer

MiB = 2**20
SETTINGS = {  # name -> (training flags, the --train fields they set, for the planner)
    "no checkpointing": ([], {}),
    "activation checkpointing": (["--train.activation_checkpointing", "true"], {"activation_checkpointing": True}),
    "offloaded activations": (["--train.offload_activations", "true"], {"offload_activations": True}),
    "optimizer in the backward pass": (["--train.optimizer_in_backward", "true", "--train.max_norm", "null"],
                                       {"optimizer_in_backward": True, "max_norm": None}),
}
DEFAULT_SETTINGS = ["no checkpointing", "activation checkpointing"]


def measure(model: str, flags: list[str], args, out_dir: Path) -> dict:
    """The run's peak memory in bytes and its tokens/s after the first step."""
    # Two micro-batches per step, except where the optimizer steps in the backward pass (it refuses accumulation).
    global_batch = args.micro_batch_size * (1 if "--train.optimizer_in_backward" in flags else 2)
    argv = [sys.executable, "-m", "litgpt", "pretrain", model, "--tokenizer_dir", str(TOKENIZER_DIR), "--data", "Tiny",
            "--data.cache_dir", str(out_dir.parent / "tiny-cache"), "--out_dir", str(out_dir),
            "--train.max_seq_length", str(args.seq_length), "--train.micro_batch_size", str(args.micro_batch_size),
            "--train.global_batch_size", str(global_batch), "--train.max_steps", str(args.steps),
            "--train.save_interval", "null", "--eval.initial_validation", "false", "--eval.final_validation", "false",
            "--precision", args.precision, "--devices", "1", "--compiler", "none", *flags]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((out_dir / "metrics.json").read_text())
    shutil.rmtree(out_dir)  # its final checkpoint (15 GiB at 1B): the next setting's disk-space check counts free space
    return {"peak": metrics["peak_memory_mb"] * MiB, "tokens_per_sec": metrics["tokens_per_sec_after_first_step"]}


def planned(model: str, train_fields: dict, args) -> float:
    from litgpt.args import TrainArgs
    from litgpt.config import Config
    from litgpt.plan import plan_for

    train = TrainArgs(micro_batch_size=args.micro_batch_size, max_seq_length=args.seq_length, **train_fields)
    plan = plan_for(Config.from_name(model), method="full", precision=args.precision, device=args.device,
                    train=train)
    return plan.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3.2-1B")
    parser.add_argument("--seq_length", type=int, default=2048)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for index, name in enumerate(args.settings):
            flags, train_fields = SETTINGS[name]
            run = measure(args.model, flags, args, Path(work) / f"run-{index}")
            measured, plan = run["peak"], planned(args.model, train_fields, args)
            rows.append({"setting": name, "flags": flags, "planned_mib": round(plan / MiB), "measured_mib":
                         round(measured / MiB), "planned_over_measured": round(plan / measured, 4),
                         "tokens_per_sec": run["tokens_per_sec"]})
            print(f"{name:<34} planned {plan / MiB:>9,.0f} MiB   measured {measured / MiB:>9,.0f} MiB   "
                  f"ratio {plan / measured:.3f}   {run['tokens_per_sec']:,.0f} tokens/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
