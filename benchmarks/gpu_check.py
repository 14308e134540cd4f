"""The GPU path in one run on one H100/H200: what a lent GPU machine must show. Every stage took about 11 minutes on
an H200 (2026-11-28, before the tensorwise training run was added), most of it the 1B runs' start-up and final
checkpoints; `--budget` (8 minutes) stops starting stages, and the plan stage, last, measures the settings that the
time left allows.

    bash benchmarks/gpu_check.sh                 # all stages, results under benchmarks/results/gpu-check-<date>/
    python benchmarks/gpu_check.py --only qlora generation --out /tmp/check

Stages, each a subprocess with its own time limit, in this order (the run starts no stage once its budget is spent):
  fp8_mlp      one Llama-3.2-1B MLP (8,192 tokens), compiled, forward + backward in bf16 and with its linear layers
               in float8 (`--precision fp8-mixed`'s conversion, rowwise and tensorwise scales), and the graph breaks
               torch.compile meets in them
  training     MFU of a Llama-3.2-1B-shaped pretrain (seq 2048, micro batch 4, global batch 32, compiled) in
               bf16-mixed and in fp8-mixed, rowwise and tensorwise (`benchmarks/run.py --suite gpu`); goals: >= 50 %
               bf16 MFU on an H100, fp8 >= 1.25x bf16
  generation   `litgpt generate` eager against `--compile true` (CUDA graphs), bf16-true
  moe          the grouped mixture-of-experts kernels against the per-expert loop (`benchmarks/moe.py`)
  chunked_loss peak memory of a step with the chunked output head + loss against whole logits
               (`benchmarks/chunked_loss_memory.py`, 128k vocabulary)
  qlora        `litgpt finetune_lora --quantize bnb.nf4` and `--quantize ao.nf4` on one GPU, on a random checkpoint
               with a 704-wide MLP. QLoRA under FSDP2 with NCCL needs two GPUs: NCCL refuses two ranks on one GPU,
               and FSDP2 on a one-rank group skips the all-gather that torchao's NF4 tensor hooks into
  plan         `litgpt plan` against the measured peak of real Llama-3.2-1B pretrain runs (`benchmarks/plan_accuracy.py`):
               plain, activation checkpointing, --train.offload_activations, --train.optimizer_in_backward, each
               with its tokens/s, each printed as it is measured

Each stage's output goes to <out>/<stage>.log (and its JSON beside it); the summary at the end is read from those
files. A stage that fails prints its last lines and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# The QLoRA stage's model: 8 layers, 1024 wide, a 704-wide MLP (rows that do not split into whole NF4 blocks
# and scale groups as stored unpadded), the tiny tokenizer's 4,096-token vocabulary.
QLORA_MODEL = dict(name="qlora-check", block_size=2048, vocab_size=4096, padded_vocab_size=4096, n_layer=8,
                   n_embd=1024, n_head=16, n_query_groups=4, intermediate_size=704, norm_class_name="RMSNorm",
                   mlp_class_name="LLaMAMLP", bias=False, rope_base=10000.0)
QLORA_STEPS = 10
PLAN_SETTINGS = ["no checkpointing", "activation checkpointing", "offloaded activations",
                 "optimizer in the backward pass"]


@dataclass
class Stage:
    name: str
    argv: list
    limit: int  # seconds


def stages(out: Path, work: Path) -> list[Stage]:
    run_py = [PYTHON, "benchmarks/run.py", "--suite", "gpu", "--repeats", "1"]
    return [
        Stage("fp8_mlp", [PYTHON, __file__, "--fp8-worker"], 90),
        Stage("training", [*run_py, "--cases", "pretrain-1b-compiled,pretrain-1b-fp8,pretrain-1b-fp8-tensorwise",
                           "--work-dir", work / "run", "--output", out / "training.json"], 400),
        Stage("generation", [*run_py, "--cases", "generate-5m-bf16-true,generate-5m-bf16-true-compiled",
                             "--work-dir", work / "run", "--output", out / "generation.json"], 90),
        Stage("moe", [PYTHON, "benchmarks/moe.py", "--device", "cuda", "--dtype", "bfloat16", "--tokens", "16384",
                      "--warmup", "2", "--steps", "5", "--only", "loop", "litgpt", "--output", out / "moe.json"], 60),
        Stage("chunked_loss", [PYTHON, "benchmarks/chunked_loss_memory.py", "--device", "cuda", "--precision",
                               "bf16-mixed", "--n_embd", "2048", "--batch", "4", "--seq", "2048", "--steps", "2",
                               "--chunk", "2048", "4096", "8192"], 90),
        Stage("qlora", [PYTHON, __file__, "--qlora-worker", "--out", out, "--work", work], 90),
        # Last: each setting is a real 1B run (~65 s); the settings the budget leaves no time for are not measured.
        Stage("plan", [PYTHON, "benchmarks/plan_accuracy.py", "--device", "cuda", "--steps", "3", "--settings",
                       *PLAN_SETTINGS, "--json", out / "plan.json"], 270),
    ]


def default_work_dir() -> Path:
    """Where the stages' runs write: a memory file system when it has room for two 1B runs' resumable checkpoints
    (15 GiB each, written at the end of every training run: on a disk they took ~50 s each of the check's time),
    else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= 40 * 2**30:
        return shm / "litgpt-gpu-check"
    return Path("/tmp/litgpt-gpu-check")


def remove_checkpoints(work: Path) -> None:
    """The stage's runs' checkpoints (15 GiB each at 1B): each run checks the free disk space for its own first."""
    for folder in [work / "run" / "out", *work.glob("qlora-*.nf4")]:
        shutil.rmtree(folder, ignore_errors=True)


def run_stage(stage: Stage, out: Path, work: Path, seconds_left: float) -> dict:
    limit = min(stage.limit, seconds_left)
    log = out / f"{stage.name}.log"
    print(f"== {stage.name} (limit {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        # TMPDIR: plan_accuracy.py's runs write into a temporary folder. A session of its own: past its limit the
        # stage is killed with the runs it started, which would otherwise hold the GPU through the next stages.
        process = subprocess.Popen([str(a) for a in stage.argv], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TMPDIR": str(work)}, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # the stage and all it started ended meanwhile
                pass
            process.wait()
            code = "timeout"
    seconds = round(time.perf_counter() - start, 1)
    remove_checkpoints(work)
    print(f"   {stage.name}: {'ok' if code == 0 else f'FAILED ({code})'} in {seconds} s", flush=True)
    if code != 0:
        print("   " + "\n   ".join(log.read_text(errors="replace").splitlines()[-20:]), flush=True)
    return {"stage": stage.name, "returncode": code, "seconds": seconds, "log": log.name}


# ---- the QLoRA stage (run as a subprocess of this script) ------------------------------------------------------------
def qlora_worker(out: Path, work: Path) -> None:
    """finetune_lora with an NF4 base stored by bitsandbytes and by torchao on one GPU."""
    checkpoint, data = qlora_inputs(work)
    results = {mode: qlora_run(checkpoint, data, work / f"qlora-{mode}", mode) for mode in ("bnb.nf4", "ao.nf4")}
    (out / "qlora.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


def qlora_inputs(work: Path) -> tuple[Path, Path]:
    """A random checkpoint of `QLORA_MODEL` with the tiny tokenizer, and instruction records from the tiny corpus."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from train import copy_tokenizer

    from litgpt.config import Config
    from litgpt.data.tiny import TINY_DIR
    from litgpt.model import GPT

    checkpoint, data = work / "qlora-checkpoint", work / "qlora-data.json"
    checkpoint.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(GPT(Config(**QLORA_MODEL)).state_dict(), checkpoint / "lit_model.pth")
    Config(**QLORA_MODEL).save(checkpoint / "model_config.yaml")
    copy_tokenizer(checkpoint)
    stories = (TINY_DIR / "train.txt").read_text().split("\n\n")[:400]
    data.write_text(json.dumps([{"instruction": "Continue the story.", "output": s} for s in stories]))
    return checkpoint, data


def qlora_run(checkpoint: Path, data: Path, run: Path, mode: str) -> dict:
    argv = [PYTHON, "-m", "litgpt", "finetune_lora", checkpoint, "--quantize", mode, "--devices", "1",
            # torchao's NF4 dequantizes under bf16-mixed's autocast; bitsandbytes computes in the stored bf16
            "--precision", "bf16-true" if mode.startswith("bnb") else "bf16-mixed", "--data", "JSON",
            "--data.json_path", data, "--data.val_split_fraction", "0.05", "--data.prompt_style", "default",
            "--train.max_steps", QLORA_STEPS, "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
            "--train.max_seq_length", "512", "--train.log_interval", "1", "--train.save_interval", "null",
            "--eval.interval", "1000", "--eval.max_iters", "2", "--eval.initial_validation", "false",
            "--eval.max_new_tokens", "0", "--lora_r", "16", "--lora_mlp", "true", "--out_dir", run]
    done = subprocess.run([str(a) for a in argv], cwd=REPO, text=True, capture_output=True)
    print(f"--- finetune_lora --quantize {mode}", done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
    if done.returncode != 0:
        return {"returncode": done.returncode}
    metrics = json.loads((run / "metrics.json").read_text())
    keep = ("precision", "peak_memory_mb", "tokens_per_sec_after_first_step", "val_loss", "device")
    return {"returncode": 0, **{key: metrics[key] for key in keep if key in metrics}}


# ---- the fp8 stage (run as a subprocess of this script) --------------------------------------------------------------
def fp8_worker() -> None:
    """Milliseconds per forward + backward of one compiled Llama-3.2-1B MLP under bf16 autocast, plain and with
    `convert_to_float8`'s layers in each recipe (`fp8` is the default, rowwise), and torch.compile's graph breaks in
    the float8 ones."""
    import copy

    import torch

    from litgpt.config import Config
    from litgpt.distributed.float8 import convert_to_float8
    from litgpt.model import GPT
    from litgpt.precision import FLOAT8_RECIPES

    config = Config.from_name("Llama-3.2-1B", n_layer=1)
    with torch.device("cuda"):
        model = GPT(config)
    mlps = {"bf16": model.transformer.h[0].mlp}
    for recipe in FLOAT8_RECIPES:
        float8 = copy.deepcopy(model)
        convert_to_float8(float8, recipe)
        mlps["fp8" if recipe == FLOAT8_RECIPES[0] else f"fp8_{recipe}"] = float8.transformer.h[0].mlp
    x = torch.randn(4, 2048, config.n_embd, device="cuda", requires_grad=True)
    results = {}
    for name, mlp in mlps.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name != "bf16":
                explained = torch._dynamo.explain(mlp)(x)
                results[f"{name}_graph_breaks"] = [str(b.reason)[:300] for b in explained.break_reasons]
            results[f"{name}_ms"] = step_milliseconds(torch.compile(mlp), x)
    for name in mlps.keys() - {"bf16"}:
        results[f"{name}_speedup"] = round(results["bf16_ms"] / results[f"{name}_ms"], 3)
    print(json.dumps(results))


def step_milliseconds(module, x, steps: int = 20) -> float:
    import torch

    for _ in range(3):
        module(x).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        module(x).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / steps, 3)


# ---- the summary --------------------------------------------------------------------------------------------------------
def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def training_lines(out: Path) -> list[str]:
    report = read_json(out / "training.json")
    if not report:
        return ["training: no results"]
    lines, rates = [], {}
    for record in report["results"]:
        runs = [r for r in record["runs"]["ours"] if "value" in r]
        if not runs:
            lines.append(f"training {record['case']}: FAILED")
            continue
        run = runs[0]
        rates[record["case"]] = run["value"]
        lines.append(f"training {record['case']}: {run['value']:,.0f} tokens/s, MFU {run.get('mfu_vs_datasheet', 0):.1%}"
                     f" of the datasheet bf16 peak ({run['mfu_vs_measured_peak']:.1%} of the measured matmul peak), "
                     f"peak memory {run.get('peak_memory_mb', 0) / 1024:.1f} GiB")
    for case, recipe in (("pretrain-1b-fp8", "rowwise"), ("pretrain-1b-fp8-tensorwise", "tensorwise")):
        if {"pretrain-1b-compiled", case} <= rates.keys():
            lines.append(f"training fp8-mixed ({recipe}) / bf16-mixed: "
                         f"{rates[case] / rates['pretrain-1b-compiled']:.2f}x")
    return lines


def moe_lines(out: Path) -> list[str]:
    report = read_json(out / "moe.json")
    if not report:
        return ["moe: no results"]
    rates = {r["name"]: r["tokens_per_s"] for r in report["results"]}
    loop = next((v for k, v in rates.items() if k.startswith("loop")), None)
    return [f"moe {name}: {rate:,.0f} tokens/s" + (f" ({rate / loop:.2f}x the loop)" if loop else "")
            for name, rate in rates.items()]


def log_tail_lines(out: Path, stage: str, keep) -> list[str]:
    log = out / f"{stage}.log"
    if not log.is_file():
        return [f"{stage}: not run"]
    return [f"{stage}: {line.strip()}" for line in log.read_text(errors="replace").splitlines() if keep(line)]


def qlora_lines(out: Path) -> list[str]:
    results = read_json(out / "qlora.json")
    if not results:
        return ["qlora: no results"]
    return [f"qlora {name}: " + ", ".join(f"{key} {value}" for key, value in facts.items())
            for name, facts in results.items()]


def generation_lines(out: Path) -> list[str]:
    report = read_json(out / "generation.json")
    if not report:
        return ["generation: no results"]
    return [f"generation {r['case']}: {r['summary']['ours']['median']:,.0f} tokens/s (warm samples)"
            if r["summary"].get("ours") else f"generation {r['case']}: FAILED" for r in report["results"]]


def summary(out: Path) -> list[str]:
    return [
        *log_tail_lines(out, "fp8_mlp", lambda line: line.startswith("{")),
        *training_lines(out), *moe_lines(out),
        *log_tail_lines(out, "chunked_loss", lambda line: "peak" in line and "ratio" in line),
        *qlora_lines(out), *generation_lines(out),
        *log_tail_lines(out, "plan", lambda line: line.startswith("|") or "planned" in line.lower()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"gpu-check-{datetime.date.today()}")
    parser.add_argument("--work", type=Path, default=None, help="default: /dev/shm/litgpt-gpu-check where it has "
                        "40 GiB free, else /tmp/litgpt-gpu-check")
    parser.add_argument("--budget", type=float, default=480, help="seconds: no stage starts after this")
    parser.add_argument("--only", nargs="*", help="stages to run (default: all, in order)")
    parser.add_argument("--qlora-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp8-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = args.work or default_work_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.qlora_worker:
        return qlora_worker(args.out, args.work)
    if args.fp8_worker:
        return fp8_worker()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_check.py needs a CUDA GPU.")
    facts = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
             "torch": torch.__version__, "capability": list(torch.cuda.get_device_capability())}
    print(f"GPU check: {facts['gpu']} (compute capability {facts['capability']}), torch {facts['torch']}; runs write "
          f"under {args.work}", flush=True)
    start, results = time.perf_counter(), []
    for stage in stages(args.out, args.work):
        if args.only and stage.name not in args.only:
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            results.append({"stage": stage.name, "returncode": "skipped: budget spent"})
            continue
        results.append(run_stage(stage, args.out, args.work, left))
    shutil.rmtree(args.work, ignore_errors=True)  # on /dev/shm it holds memory
    lines = summary(args.out)
    (args.out / "summary.json").write_text(json.dumps({**facts, "stages": results, "summary": lines}, indent=1) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
