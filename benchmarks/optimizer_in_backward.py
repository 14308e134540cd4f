"""Peak memory and step time of `litgpt pretrain` with and without `--train.optimizer_in_backward`, on the CPU.

    python benchmarks/optimizer_in_backward.py                      # ~91M-parameter Llama shape, 5 steps, A B A B
    python benchmarks/optimizer_in_backward.py --repeats 3 --output benchmarks/results/oib.json

Each run is the real command in a fresh process (float32, AdamW, one micro-batch of 1 x 128 tokens per step, no
clipping: what the option needs), its malloc handing freed memory straight back to the OS (the glibc tunables
tests/test_plan.py measures with) so that the resident set follows the tensors. Reported per run: the process's peak
resident memory when the last step is logged (before the final checkpoint is written, which has peaks of its own), and
the seconds per step after the first (`metrics.json`); the two settings alternate (A B A B), after a run that
tokenizes the data into the shared cache (not counted). Wall time follows the neighbours on a shared host, so the
step's CPU time is measured too: both settings' models in one process, their steps taken in turn (the same forward,
backward and AdamW as the command, on one random batch), the median of `--cpu_steps` steps each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MALLOC_RETURNS_FREED_MEMORY = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"


def model_config(width: int, layers: int) -> dict:
    return dict(name=f"oib-bench-{width}x{layers}", n_layer=layers, n_embd=width, n_head=width // 64,
                n_query_groups=width // 64, intermediate_size=width * 8 // 3, vocab_size=4096, padded_vocab_size=4096,
                block_size=128, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")


def run(folder: Path, in_backward: bool, args: argparse.Namespace, index: int) -> dict:
    """One `litgpt pretrain` run: its peak RSS at the last step's log line (MiB) and its seconds per later step."""
    from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR

    out_dir = folder / f"run-{index}-{'oib' if in_backward else 'after'}"
    command = [
        sys.executable, "-m", "litgpt", "pretrain", "--model_config", json.dumps(model_config(args.width, args.layers)),
        "--tokenizer_dir", str(TOKENIZER_DIR), "--data", "TextFiles", "--data.train_data_path", str(TINY_DIR),
        "--data.cache_dir", str(folder / "cache"), "--out_dir", str(out_dir), "--precision", "32-true",
        "--train.global_batch_size", "1", "--train.micro_batch_size", "1", "--train.max_seq_length", "128",
        "--train.max_steps", str(args.steps), "--train.max_norm", "null", "--train.save_interval", "null",
        "--train.lr_warmup_steps", "1", "--eval.interval", "1000", "--eval.max_iters", "1",
        "--eval.final_validation", "false", "--compiler", "none",
        "--train.optimizer_in_backward", str(in_backward).lower(),
    ]
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_RETURNS_FREED_MEMORY, "OMP_NUM_THREADS": str(args.threads)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    number = lambda pattern: int(re.findall(pattern, result.stdout)[-1].replace(",", ""))  # noqa: E731
    metrics = json.loads((out_dir / "metrics.json").read_text())
    later_steps = metrics["train_seconds"] - metrics["first_step_seconds"]
    return {"optimizer_in_backward": in_backward, "peak_rss_mib": number(r"peak mem ([\d,]+) MB"),
            "seconds_per_step": round(later_steps / (args.steps - 1), 3),
            "trainable_params": number(r"([\d,]+) trainable parameters")}


def step_cpu_seconds(args: argparse.Namespace) -> dict[bool, float]:
    """The median CPU time of a training step (forward, backward, AdamW), each setting's steps taken in turn."""
    import time

    import torch

    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.train.loss import loss_function
    from litgpt.train.optimizer import build_optimizer
    from litgpt.train.optimizer_in_backward import OptimizerInBackward

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu, loss = torch.device("cpu"), loss_function("cross_entropy", None)
    tokens = torch.randint(0, 4096, (1, 129))
    runs, seconds = {}, {False: [], True: []}
    for in_backward in (False, True):
        model = GPT(Config(**model_config(args.width, args.layers)))
        model.init_weights()
        runs[in_backward] = model, (
            OptimizerInBackward(lambda one: build_optimizer("AdamW", one, cpu), model.parameters()) if in_backward
            else build_optimizer("AdamW", model.parameters(), cpu))
    for step in range(args.cpu_steps + 1):
        for in_backward, (model, optimizer) in runs.items():
            start = time.process_time()
            loss(model, tokens[:, :-1], tokens[:, 1:])["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:  # the first builds the optimizer state
                seconds[in_backward].append(time.process_time() - start)
    return {in_backward: round(statistics.median(times), 3) for in_backward, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu_steps", type=int, default=8)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    runs, load_before = [], os.getloadavg()  # other users of a shared machine show in the step times
    with tempfile.TemporaryDirectory() as folder:
        run(Path(folder), False, argparse.Namespace(**{**vars(args), "steps": 2}), -1)  # tokenizes the data, uncounted
        for repeat in range(args.repeats):
            for in_backward in (False, True):  # A B A B
                runs.append(run(Path(folder), in_backward, args, len(runs)))
                print(json.dumps(runs[-1]), flush=True)
    cpu_seconds = step_cpu_seconds(args)
    for in_backward in (False, True):
        mine = [r for r in runs if r["optimizer_in_backward"] == in_backward]
        print(f"optimizer_in_backward={str(in_backward).lower():5}: peak RSS "
              f"{', '.join(str(r['peak_rss_mib']) for r in mine)} MiB; wall s/step "
              f"{', '.join(str(r['seconds_per_step']) for r in mine)} "
              f"(median {statistics.median(r['seconds_per_step'] for r in mine):.3f}); "
              f"CPU s/step (median) {cpu_seconds[in_backward]}")
    if args.output is not None:
        temporary = args.output.with_name(args.output.name + ".tmp")
        temporary.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)}, "runs": runs,
                                         "step_cpu_seconds_median": {"after_backward": cpu_seconds[False],
                                                                     "in_backward": cpu_seconds[True]},
                                         "load_average_before": load_before, "load_average_after": os.getloadavg()},
                                        indent=2))
        temporary.replace(args.output)


if __name__ == "__main__":
    main()
