"""Packed finetuning: real (non-padding) tokens/s of `litgpt finetune_full` / `finetune_lora` with and without
`--data.packing true`, on Alpaca-like data whose lengths spread as instruction data's do.

The data: instruction records cut from the bundled story corpus, each of a token count drawn from a log-normal
distribution (median `--median` tokens, default 160, shape `--sigma` 0.75: the cleaned Alpaca set measures a median
of about 150-200 tokens with the Alpaca template and a long tail), prompt about 40 % of it, laid out in the `default`
prompt style; samples longer than `--max-seq-length` are cut, as they are in training. The model: the Llama-shaped
5M model of benchmarks/train.py (4 layers, n_embd 256, 4 heads / 2 KV groups, vocab 4096) with random weights.

Each run is the real command in a child process (`--train.log_interval 1`, no validation, sampling or checkpoint
inside the measured steps); cases alternate packed and unpacked (A B A B ...), so both see the same load of a shared
machine. A step's time is the trainer's own (its csv log: the step's tokens over its tokens_per_sec, logging left out);
its real tokens are counted here from the same loader the run used (`MicroBatches` over the same data module, seed and
micro-batch size): the samples' tokens, no padding. The first `--warmup` steps are left out.

    python benchmarks/packing.py --repeats 2 --steps 30 --output benchmarks/results/packing-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_DIR = ROOT / "litgpt" / "data" / "tiny"
MODEL = dict(name="bench-llama", n_layer=4, n_embd=256, n_head=4, n_query_groups=2, intermediate_size=688,
             vocab_size=4096, padded_vocab_size=4096, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
             bias=False, rotary_percentage=1.0, parallel_residual=False)
BIG = 1_000_000  # an interval no run reaches (validation, checkpoints)


def write_checkpoint(folder: Path, block_size: int) -> Path:
    """A random checkpoint of the 5M Llama shape with the bundled tokenizer."""
    from litgpt.config import Config
    from litgpt.io import save_state_dict
    from litgpt.model import GPT

    folder.mkdir(parents=True, exist_ok=True)
    config = Config(**MODEL, block_size=block_size)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_state_dict(model.state_dict(), folder / "lit_model.pth")
    config.save(folder / "model_config.yaml")
    for file in (TINY_DIR / "tokenizer").iterdir():
        shutil.copy2(file, folder / file.name)
    return folder


def write_records(path: Path, count: int, median: float, sigma: float, max_length: int, seed: int) -> list[int]:
    """`count` records of log-normal token counts (prompt ~40 %, response the rest), cut from the story corpus;
    returns the drawn lengths."""
    from litgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(TINY_DIR / "tokenizer")
    corpus = tokenizer.encode((TINY_DIR / "train.txt").read_text(), bos=False).tolist()
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(count, generator=generator) * sigma + torch.log(torch.tensor(median)))
    lengths = lengths.round().clamp(8, 2 * max_length).long().tolist()
    starts = torch.randint(0, len(corpus) - 2 * max_length, (count,), generator=generator).tolist()
    records = []
    for n, start in zip(lengths, starts):
        prompt = max(2, int(0.4 * n))
        records.append({"instruction": tokenizer.decode(corpus[start:start + prompt]),
                        "output": tokenizer.decode(corpus[start + prompt:start + n])})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return lengths


def data_module(records: Path, packing: bool):
    from litgpt.data import JSON

    return JSON(records, val_split_fraction=0.02, prompt_style="default", packing=packing)


def tokens_per_step(records: Path, packing: bool, checkpoint: Path, args) -> tuple[list[int], list[int]]:
    """(the samples' own tokens, the tokens with padding) of each step the run takes: its loader, replayed."""
    from litgpt.data.base import MicroBatches
    from litgpt.tokenizer import Tokenizer

    data = data_module(records, packing)
    data.connect(Tokenizer(checkpoint), args.max_seq_length)
    data.prepare()
    dataset = data.train_dataset()
    loader = MicroBatches(dataset, args.micro_batch_size, args.seed)
    if loader.per_epoch < args.steps:
        raise SystemExit(f"{args.steps} steps need more than one epoch: raise --records")
    # A sample's (or a pack's) own tokens, before collation pads the micro-batch to its longest row.
    lengths = [[dataset[int(i)]["input_ids"].numel() for i in rows] for rows in loader.indices(0)[: args.steps]]
    return [sum(row) for row in lengths], [len(row) * max(row) for row in lengths]


def run(command: str, checkpoint: Path, records: Path, packing: bool, out_dir: Path, args) -> tuple[list, dict]:
    """One training run: its steps' seconds from its csv log, and the child's CPU seconds when each step's log line
    came (a shared machine's load stretches the wall time, much less the CPU time)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "litgpt", command, str(checkpoint), "--out_dir", str(out_dir),
            "--data", "JSON", "--data.json_path", str(records), "--data.val_split_fraction", "0.02",
            "--data.prompt_style", "default", "--data.packing", str(packing).lower(),
            "--precision", args.precision, "--seed", str(args.seed),
            "--train.max_seq_length", str(args.max_seq_length), "--train.micro_batch_size", str(args.micro_batch_size),
            "--train.global_batch_size", str(args.micro_batch_size), "--train.max_steps", str(args.steps),
            "--train.log_interval", "1", "--train.save_interval", str(BIG), "--train.lr_warmup_steps", "2",
            "--eval.interval", str(BIG), "--eval.initial_validation", "false", "--eval.final_validation", "false",
            "--eval.max_new_tokens", "0", "--eval.max_iters", "1", "--logger_name", "csv"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu_at_step, output = {}, []
    for line in child.stdout:
        output.append(line)
        match = re.match(r"step (\d+)/\d+ \|", line)
        if match:
            cpu_at_step[int(match.group(1))] = cpu_seconds(child.pid)
    if child.wait() != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{''.join(output)[-4000:]}")
    rows = [r for r in csv.DictReader(open(next(out_dir.rglob("metrics.csv")))) if r.get("tokens_per_sec")]
    seconds, previous = [], 0
    for row in rows:
        tokens = int(float(row["tokens"]))
        seconds.append((tokens - previous) / float(row["tokens_per_sec"]))
        previous = tokens
    return seconds, cpu_at_step


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name and its bf16 units, as /proc/cpuinfo names them."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    units = sorted({flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in info})
    return " ".join([name.group(1) if name else platform.machine(), *units])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", nargs="+", default=["finetune_full", "finetune_lora"])
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--median", type=float, default=160.0)
    parser.add_argument("--sigma", type=float, default=0.75)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--work", type=Path, default=Path("/tmp/litgpt-packing-bench"))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.warmup >= args.steps:
        raise SystemExit("--warmup must be below --steps")

    checkpoint = write_checkpoint(args.work / "checkpoint", args.max_seq_length)
    records = args.work / "records.jsonl"
    drawn = write_records(records, args.records, args.median, args.sigma, args.max_seq_length, args.seed)
    measured = {packing: tokens_per_step(records, packing, checkpoint, args) for packing in (False, True)}
    real = {packing: real_tokens for packing, (real_tokens, _) in measured.items()}
    padded = measured[False][1]
    lengths = [min(n, args.max_seq_length) for n in drawn]
    print(f"data: {len(drawn)} records, drawn median {statistics.median(drawn):.0f} tokens, "
          f"p90 {sorted(drawn)[int(0.9 * len(drawn))]}, {sum(n > args.max_seq_length for n in drawn)} cut at "
          f"{args.max_seq_length}; real tokens per step unpacked {statistics.mean(real[False]):.0f}, packed "
          f"{statistics.mean(real[True]):.0f} of {args.micro_batch_size * args.max_seq_length}; unpacked micro-batches "
          f"padded to {statistics.mean(padded):.0f} tokens per step")

    results = []
    for command in args.commands:
        rates = {(packing, clock): [] for packing in (False, True) for clock in ("wall", "cpu")}
        for repeat in range(args.repeats):
            for packing in (False, True):  # A B A B
                seconds, cpu_at_step = run(command, checkpoint, records, packing, args.work / "out", args)
                tokens = sum(real[packing][args.warmup:args.steps])
                wall = tokens / sum(seconds[args.warmup:args.steps])
                cpu = tokens / (cpu_at_step[args.steps] - cpu_at_step[args.warmup])
                rates[packing, "wall"].append(wall)
                rates[packing, "cpu"].append(cpu)
                print(f"{command} packing={str(packing).lower()} run {repeat + 1}: {wall:,.0f} real tokens/s "
                      f"(wall), {cpu:,.0f} per CPU second", flush=True)
        results.append({
            "command": command,
            **{f"{'packed' if p else 'unpacked'}_tokens_per_s_{clock}": v for (p, clock), v in rates.items()},
            **{f"ratios_{clock}": [b / a for a, b in zip(rates[False, clock], rates[True, clock])]
               for clock in ("wall", "cpu")},
        })

    print("\n| command | clock | unpacked real tokens/s | packed real tokens/s | packed / unpacked, per A B pair |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        for clock in ("wall", "cpu"):
            print(f"| {r['command']} | {clock} | {statistics.median(r[f'unpacked_tokens_per_s_{clock}']):,.0f} | "
                  f"{statistics.median(r[f'packed_tokens_per_s_{clock}']):,.0f} | "
                  f"{', '.join(f'{x:.2f}x' for x in r[f'ratios_{clock}'])} |")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                        "torch": torch.__version__, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "data": {"records": len(drawn), "median_tokens": statistics.median(drawn),
                     "median_after_cut": statistics.median(lengths),
                     "real_tokens_per_step": {"unpacked": statistics.mean(real[False]),
                                              "packed": statistics.mean(real[True])},
                     "unpacked_padded_tokens_per_step": statistics.mean(padded)},
            "results": results,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
