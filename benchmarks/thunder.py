"""Tokens/s of `litgpt pretrain` eager vs `--compiler thunder` vs `--compiler torch`, with 1 and 2 processes.

Every case is one `litgpt pretrain --config config_hub/pretrain/tiny.yaml` run, the small Llama shape (4 layers,
n_embd 256, 4 heads / 2 KV groups, vocab 4096), micro batch 4 x sequence 256, with the same global batch (8) for 1
and 2 processes, no validation or sampling. 2 processes: FSDP2 FULL_SHARD for eager and torch (each block compiled),
Thunder's FSDP (ZeRO-3, BLOCK bucketing) for thunder. The figure is the median of the per-step tokens/s the run logs
(metrics.csv), leaving out the first `--warmup` steps, where thunder traces and torch.compile compiles; the time of
that first step is reported on its own (`first_step_seconds`).

    python benchmarks/thunder.py                    # every case, 8 steps
    python benchmarks/thunder.py --processes 1 --compilers none thunder --steps 4 --warmup 2

On a GPU (found by torch) the same cases run there (default precision: bf16-mixed), and the JSON records whether
thunder needed the named-tensor compatibility module on that torch (`compat_shim_needed`). It writes
benchmarks/results/thunder-<date>[-gpu].json.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as `python benchmarks/thunder.py`, this file's folder comes first on sys.path and this file would be the
# `thunder` that `import thunder` finds: leave the folder out.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "config_hub" / "pretrain" / "tiny.yaml"
COMPILERS = ("none", "thunder", "torch")
MICRO_BATCH, GLOBAL_BATCH, SEQ = 4, 8, 256


def run_case(compiler: str, processes: int, steps: int, warmup: int, work: Path) -> dict:
    out_dir = work / f"{compiler}-{processes}"
    command = [
        sys.executable, "-m", "litgpt", "pretrain", "--config", str(TINY_RECIPE), "--out_dir", str(out_dir),
        "--data.cache_dir", str(work / "cache"), "--devices", str(processes), "--compiler", compiler,
        "--strategy", "fsdp", "--train.max_steps", str(steps), "--train.log_interval", "1",
        "--train.micro_batch_size", str(MICRO_BATCH), "--train.global_batch_size", str(GLOBAL_BATCH),
        "--train.max_seq_length", str(SEQ), "--train.save_interval", "null", "--train.lr_warmup_steps", "1",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--eval.max_new_tokens", "0",
    ]
    if processes > 1 and compiler != "thunder":
        command += ["--fsdp.sharding_strategy", "FULL_SHARD"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{compiler} x {processes} failed:\n{result.stderr[-3000:]}")
    per_step = step_tokens_per_second(out_dir)
    return {
        "compiler": compiler,
        "processes": processes,
        "tokens_per_sec": round(statistics.median(per_step[warmup:]), 1),
        "first_step_seconds": round(GLOBAL_BATCH * SEQ / per_step[0], 1),
        "per_step_tokens_per_sec": [round(value, 1) for value in per_step],
        "command": " ".join(command[1:]),
    }


def step_tokens_per_second(out_dir: Path) -> list[float]:
    (log,) = out_dir.rglob("metrics.csv")
    with open(log) as f:
        return [float(row["tokens_per_sec"]) for row in csv.DictReader(f) if row.get("tokens_per_sec")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compilers", nargs="+", default=list(COMPILERS), choices=COMPILERS)
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if not torch.cuda.is_available() and max(args.processes) > (os.cpu_count() or 1):
        parser.error(f"--processes above this machine's {os.cpu_count()} cores")

    from extensions.thunder.compat import NAMED_TENSOR_METHODS, import_thunder

    missing = [name for name in NAMED_TENSOR_METHODS if not hasattr(torch.Tensor, name)]
    thunder, _ = import_thunder()
    from litgpt.train.metrics import cpu_name

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "thunder": thunder.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "compat_shim_needed": missing}
    print(f"torch {torch.__version__}, thunder {thunder.__version__}; named-tensor methods torch lacks (added for "
          f"thunder): {', '.join(missing) or 'none'}")
    results = []
    print("compiler  processes   tokens/s   first step (s)", flush=True)
    with tempfile.TemporaryDirectory() as work:
        for processes in args.processes:
            for compiler in args.compilers:
                result = run_case(compiler, processes, args.steps, args.warmup, Path(work))
                results.append(result)
                print(f"{compiler:<9} {processes:>9} {result['tokens_per_sec']:>10,.0f} "
                      f"{result['first_step_seconds']:>16,.1f}", flush=True)
    suffix = "-gpu" if info["gpu"] else ""
    output = args.output or REPO / "benchmarks" / "results" / f"thunder-{datetime.date.today()}{suffix}.json"
    output.write_text(json.dumps({"machine": info, "steps": args.steps, "warmup": args.warmup,
                                  "micro_batch_size": MICRO_BATCH, "global_batch_size": GLOBAL_BATCH,
                                  "seq_length": SEQ, "results": results}, indent=2) + "\n")
    print(f"Wrote {output}")


if __name__ == "__main__":
    main()
