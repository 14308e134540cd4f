"""Tokens/s and per-rank peak memory of `litgpt pretrain` with 1, 2 and 4 processes and every sharding strategy.

Each case is one `litgpt pretrain` run of the bundled tiny corpus on a Llama-shaped model, with the same global
batch whatever the number of processes (so the runs do the same work); the figures come from the run's own
metrics.json: `tokens_per_sec` (tokens over the time spent in optimizer steps, all steps) and
`peak_memory_mb_per_rank` (each rank's peak RSS on CPU, `torch.cuda.max_memory_allocated` on GPU). 4 processes are
two `torchrun --nnodes 2 --nproc_per_node 2` launches on this machine (HYBRID_SHARD's 2 x 2 mesh). Memory comes from a
second, 2-step run of each case with GLIBC_TUNABLES set so that freed memory returns to the OS and RSS shows what each
rank holds (that setting slows allocation, so the throughput run goes without it).

    python benchmarks/distributed.py                       # both models, every case
    python benchmarks/distributed.py --models small --steps 4
    python benchmarks/distributed.py --models 100m --prefetch 0 1 2 --repeats 2   # FSDP2's explicit prefetching
    python benchmarks/distributed.py --models small --parallel tp2 pp2 ep2 cp2   # tensor, pipeline, expert, context

`--prefetch N ...` runs, instead of the cases above, 2 processes with FULL_SHARD and `--fsdp.forward_prefetch N
--fsdp.backward_prefetch N` for each N (0: FSDP2's implicit order), `--repeats` times with the settings interleaved
(a busy spell of a shared host then falls on all of them); it reports the median tokens/s and step time, and the
peak memory per rank.

`--parallel CASE ...` runs, instead, the parallelisms beside FSDP (PARALLEL_CASES: tensor, pipeline, expert, context
and their mixes with FSDP) against the 1-process run of the same model and global batch; expert parallelism runs the MoE shape
of config_hub/pretrain/tiny-moe.yaml (8 experts, 2 per token) and its own 1-process baseline. On a CPU (gloo) these
figures are for the record: the collectives cost more than the split compute saves; on GPUs (NCCL, a process per
GPU) they show what each layout costs.

Models: `small`, the ~5M shape of config_hub/pretrain/tiny.yaml (4 layers, n_embd 256, GQA 4/2, vocab 4096),
micro batch 4 x seq 256; `100m`, a ~100M Llama shape (12 layers, n_embd 768, 12 heads / 4 KV groups,
intermediate 2048, vocab 4096 tokenizer in a 32000-row embedding), micro batch 2 x seq 256.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "config_hub" / "pretrain" / "tiny.yaml"
MODELS = {
    "small": {"micro_batch_size": 4, "overrides": []},
    "100m": {
        "micro_batch_size": 2,
        "overrides": [
            "--model_config.name", "llama-100m", "--model_config.n_layer", "12", "--model_config.n_embd", "768",
            "--model_config.n_head", "12", "--model_config.n_query_groups", "4",
            "--model_config.intermediate_size", "2048", "--model_config.padded_vocab_size", "32000",
        ],
    },
}
# (processes, strategy); 4 processes run as two torchrun "nodes" of 2.
CASES = [(1, None), (2, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (2, "NO_SHARD"), (4, "HYBRID_SHARD"), (4, "FULL_SHARD")]
MOE_RECIPE = REPO / "config_hub" / "pretrain" / "tiny-moe.yaml"
# name -> (processes, --parallel flags, recipe); FSDP (FULL_SHARD) takes the processes the degrees leave.
PARALLEL_CASES = {
    "tp2": (2, ["--parallel.tensor", "2"], TINY_RECIPE),
    "cp2": (2, ["--parallel.context", "2"], TINY_RECIPE),
    "tp2-cp2": (4, ["--parallel.tensor", "2", "--parallel.context", "2"], TINY_RECIPE),
    "tp2-fsdp2": (4, ["--parallel.tensor", "2"], TINY_RECIPE),
    "pp2": (2, ["--parallel.pipeline", "2"], TINY_RECIPE),
    "pp2-fsdp2": (4, ["--parallel.pipeline", "2"], TINY_RECIPE),
    "pp2-tp2": (4, ["--parallel.pipeline", "2", "--parallel.tensor", "2"], TINY_RECIPE),
    "pp2-cp2": (4, ["--parallel.pipeline", "2", "--parallel.context", "2"], TINY_RECIPE),
    "pp2-ep2": (4, ["--parallel.pipeline", "2", "--parallel.expert", "2"], MOE_RECIPE),
    "ep2": (2, ["--parallel.expert", "2"], MOE_RECIPE),
    "ep2-fsdp2": (4, ["--parallel.expert", "2"], MOE_RECIPE),
    "cp2-ep2": (2, ["--parallel.context", "2", "--parallel.expert", "2"], MOE_RECIPE),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(model: str, processes: int, strategy, steps: int, work: Path) -> dict:
    """Throughput from a run of `steps` steps; per-rank peak memory from a 2-step run that returns freed memory."""
    throughput = launch(model, processes, strategy, steps, work / "throughput", {})
    memory = launch(model, processes, strategy, 2, work / "memory", {"GLIBC_TUNABLES": RETURN_FREED_MEMORY})
    return {
        "model": model, "processes": processes, "strategy": strategy or "none",
        "tokens_per_sec": throughput["metrics"]["tokens_per_sec"],
        "peak_memory_mb_per_rank": memory["metrics"]["peak_memory_mb_per_rank"],
        "command": throughput["command"],
    }


RETURN_FREED_MEMORY = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"


def run_prefetch_cases(model: str, settings: list[int], steps: int, repeats: int, work: Path) -> list[dict]:
    """2 processes, FULL_SHARD, forward and backward prefetch N for each N in `settings`: the median tokens/s of
    `repeats` interleaved runs, the median step time, and per-rank peak memory from a 2-step run."""
    tokens_per_sec, step_seconds = {n: [] for n in settings}, {n: [] for n in settings}
    commands = {}
    for repeat in range(repeats):
        for n in settings:
            run = launch(model, 2, "FULL_SHARD", steps, work / f"throughput-{repeat}", {}, prefetch_flags(n))
            tokens_per_sec[n].append(run["metrics"]["tokens_per_sec"])
            step_seconds[n].append(run["metrics"]["train_seconds"] / run["metrics"]["steps"])
            commands[n] = run["command"]
    results = []
    for n in settings:
        memory = launch(model, 2, "FULL_SHARD", 2, work / "memory", {"GLIBC_TUNABLES": RETURN_FREED_MEMORY},
                        prefetch_flags(n))
        results.append({
            "model": model, "processes": 2, "strategy": "FULL_SHARD", "forward_prefetch": n, "backward_prefetch": n,
            "tokens_per_sec": round(statistics.median(tokens_per_sec[n]), 1), "tokens_per_sec_runs": tokens_per_sec[n],
            "step_seconds": round(statistics.median(step_seconds[n]), 3),
            "peak_memory_mb_per_rank": memory["metrics"]["peak_memory_mb_per_rank"], "command": commands[n],
        })
    return results


def prefetch_flags(n: int) -> list[str]:
    return ["--fsdp.forward_prefetch", str(n), "--fsdp.backward_prefetch", str(n)]


def launch(model: str, processes: int, strategy, steps: int, work: Path, extra_env: dict, flags=(),
           recipe: Path = TINY_RECIPE) -> dict:
    spec = MODELS[model]
    name = "".join(flags).replace("--fsdp.", "-").replace("--parallel.", "-")
    out_dir = work / f"{model}-{recipe.stem}-{processes}-{strategy or 'single'}{name}"
    micro = spec["micro_batch_size"]
    global_batch = micro * 4  # the same samples per step for 1, 2 and 4 processes
    args = [
        "pretrain", "--config", str(recipe), *spec["overrides"], "--out_dir", str(out_dir),
        "--data.cache_dir", str(work.parent / "cache"), "--train.max_steps", str(steps), "--train.log_interval", str(steps),
        "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(global_batch),
        "--train.save_interval", "null", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--eval.max_new_tokens", "0", "--train.lr_warmup_steps", "1", *flags,
    ]
    env = {**os.environ, **extra_env}
    if processes == 1:
        commands = [[sys.executable, "-m", "litgpt", *args, "--devices", "1"]]
    elif processes == 2 or any(flag.startswith("--parallel.") for flag in flags):
        # one node: a tensor or context group lies within a node
        commands = [[sys.executable, "-m", "litgpt", *args, "--devices", str(processes), "--fsdp.sharding_strategy",
                     strategy]]
    else:
        port = str(free_port())
        commands = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--node_rank",
             str(rank), "--master_addr", "127.0.0.1", "--master_port", port, "-m", "litgpt", *args, "--devices", "2",
             "--num_nodes", "2", "--fsdp.sharding_strategy", strategy]
            for rank in (0, 1)
        ]
    launched = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for c in commands]
    errors = [p.communicate()[1] for p in launched]
    if any(p.returncode for p in launched):
        raise SystemExit(f"{model} {processes} {strategy} failed:\n" + "\n".join(e[-2000:] for e in errors))
    metrics = json.loads((out_dir / "metrics.json").read_text())
    return {"metrics": metrics, "command": " & ".join(" ".join(c) for c in commands)}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def print_strategy_cases(model: str, steps: int, work: Path) -> list[dict]:
    print(f"\n{model}: processes  strategy       tokens/s   peak MB per rank", flush=True)
    results, baseline = [], None
    for processes, strategy in CASES:
        result = run_case(model, processes, strategy, steps, work)
        baseline = baseline or result["tokens_per_sec"]
        results.append(result)
        peaks = ", ".join(f"{peak:,.0f}" for peak in result["peak_memory_mb_per_rank"])
        print(f"{model:>5}: {processes:>9}  {result['strategy']:<13} {result['tokens_per_sec']:>9,.0f} "
              f"({result['tokens_per_sec'] / baseline:.2f}x)  [{peaks}]", flush=True)
    return results


def run_parallel_cases(model: str, names: list[str], steps: int, work: Path) -> list[dict]:
    """Each case of PARALLEL_CASES in `names` (FULL_SHARD over the processes its degrees leave), and before the first
    case of each recipe that recipe's 1-process run: tokens/s, the ratio to that run, per-rank peak memory."""
    results, baselines = [], {}
    for name in names:
        processes, flags, recipe = PARALLEL_CASES[name]
        if recipe not in baselines:
            baselines[recipe] = parallel_case(model, "1 process", 1, None, [], recipe, steps, work)
            results.append(baselines[recipe])
        result = parallel_case(model, name, processes, "FULL_SHARD", flags, recipe, steps, work)
        result["speedup"] = round(result["tokens_per_sec"] / baselines[recipe]["tokens_per_sec"], 3)
        results.append(result)
    return results


def parallel_case(model: str, name: str, processes: int, strategy, flags: list[str], recipe: Path, steps: int,
                  work: Path) -> dict:
    throughput = launch(model, processes, strategy, steps, work / "throughput", {}, flags, recipe)
    memory = launch(model, processes, strategy, 2, work / "memory", {"GLIBC_TUNABLES": RETURN_FREED_MEMORY}, flags,
                    recipe)
    return {"model": model, "recipe": recipe.name, "case": name, "processes": processes, "flags": flags,
            "tokens_per_sec": throughput["metrics"]["tokens_per_sec"],
            "peak_memory_mb_per_rank": memory["metrics"]["peak_memory_mb_per_rank"], "command": throughput["command"]}


def print_parallel_cases(model: str, names: list[str], steps: int, work: Path) -> list[dict]:
    print(f"\n{model}: recipe          case        processes  tokens/s   peak MB per rank", flush=True)
    results = run_parallel_cases(model, names, steps, work)
    for result in results:
        peaks = ", ".join(f"{peak:,.0f}" for peak in result["peak_memory_mb_per_rank"])
        ratio = f"({result['speedup']:.2f}x)" if "speedup" in result else ""
        print(f"{model:>5}: {result['recipe']:<15} {result['case']:<11} {result['processes']:>9}  "
              f"{result['tokens_per_sec']:>8,.0f} {ratio:<8} [{peaks}]", flush=True)
    return results


def print_prefetch_cases(model: str, settings: list[int], steps: int, repeats: int, work: Path) -> list[dict]:
    print(f"\n{model}: 2 processes, FULL_SHARD  prefetch  tokens/s (runs)  step s  peak MB per rank", flush=True)
    results = run_prefetch_cases(model, settings, steps, repeats, work)
    for result in results:
        runs = ", ".join(f"{t:,.0f}" for t in result["tokens_per_sec_runs"])
        peaks = ", ".join(f"{peak:,.0f}" for peak in result["peak_memory_mb_per_rank"])
        print(f"{model:>5}: {result['forward_prefetch']:>27}  {result['tokens_per_sec']:>8,.0f} ({runs})  "
              f"{result['step_seconds']:>6.2f}  [{peaks}]", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--prefetch", type=int, nargs="+", default=None,
                        help="instead of the cases: 2 processes, FULL_SHARD, forward/backward prefetch N for each N")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each --prefetch setting (the median counts)")
    parser.add_argument("--parallel", nargs="+", default=None, choices=list(PARALLEL_CASES),
                        help="instead of the cases: tensor, expert and context parallelism beside FSDP")
    args = parser.parse_args()
    if args.prefetch is not None and args.parallel is not None:
        parser.error("give --prefetch or --parallel, not both")
    results = []
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            if args.prefetch is not None:
                results += print_prefetch_cases(model, args.prefetch, args.steps, args.repeats, Path(work))
            elif args.parallel is not None:
                results += print_parallel_cases(model, args.parallel, args.steps, Path(work))
            else:
                results += print_strategy_cases(model, args.steps, Path(work))
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    kind = "prefetch-" if args.prefetch is not None else "parallel-" if args.parallel is not None else ""
    name = f"distributed-{kind}{datetime.date.today()}.json"
    output = args.output or REPO / "benchmarks" / "results" / name
    record = {"machine": machine, "steps": args.steps, "repeats": args.repeats, "results": results}
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nWrote {output}")


if __name__ == "__main__":
    main()
