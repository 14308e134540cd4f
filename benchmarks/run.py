"""The benchmark suite: training, generation and start-up, ours side by side with LitGPT 0.5.13, and MFU.

    python benchmarks/run.py --suite cpu --litgpt-venv /tmp/litgpt-ref --ours-venv /tmp/litgpt-ours
    python benchmarks/run.py --suite gpu
    python benchmarks/run.py --suite cpu --cases generate-5m-bf16-true,help --repeats 5

Every case runs `--repeats` times; with a reference toolkit the runs alternate (ours, LitGPT, ours, LitGPT, ...), so
both see the same machine. The table gives the median and the min-max of each toolkit and the ratio of the medians;
the JSON (`benchmarks/results/run-<suite>-<date>.json`) adds the machine (CPU model, cores, torch, GPU), the measured
matmul peaks, the exact command of every case and every run.

Training cases are measured by `train.py`'s harness: tokens/s over the steps after the warm-up (from the arrival
times of the per-step log lines), peak RSS of the training process (rank 0 with several processes), or the
`peak_memory_mb` of metrics.json on a GPU. MFU = training FLOPs per token (6N plus the attention term, PaLM's count,
with the frozen weights' gradient third left out for LoRA) x tokens/s / the peak FLOP/s of a large matmul measured
here in the run's compute dtype (fp32 for 32-true; for bf16-mixed the faster of bf16 and fp32, as a CPU without bf16
matrix units multiplies bf16 slower than fp32); on GPUs also against the datasheet peak.

Generation cases: tokens/s of samples 2..N of one `generate --num_samples N` (each toolkit prints its own per-sample
figure; sample 1, which pays any compilation, is kept as "cold"). `help`: the wall time of the `litgpt --help`
console script of each environment.

`--ours-venv` runs our litgpt from a virtual environment with only its own dependencies (`pip install torch==2.13.0`,
then `pip install -e .`): the development environment also has `transformers` and `scipy`, which Lightning's import
of `torchmetrics` loads when present (~90 MB of RSS, ~3 s), and a user's install does not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as harness  # noqa: E402  (the training measurement, shared with benchmarks/train.py)

REPO = harness.REPO
PRECISIONS = ("32-true", "bf16-mixed", "default")  # "default": no --precision, each toolkit's own
STEPS_100M = (3, 20)  # (warm-up, measured) steps of the ~100M cases: ~7 s a step on 2 cores
TRAINING_CPU = ["pretrain-5m-default", "pretrain-5m-32-true", "pretrain-5m-bf16-mixed", "pretrain-tiny-default",
                "pretrain-100m-default", "pretrain-100m-32-true", "pretrain-100m-bf16-mixed", "lora-5m-32-true",
                "lora-5m-bf16-mixed", "pretrain-5m-2proc-FULL_SHARD", "pretrain-5m-2proc-SHARD_GRAD_OP",
                "pretrain-5m-2proc-NO_SHARD",
                "pretrain-5m-2proc-HYBRID_SHARD", "pretrain-100m-1proc", "pretrain-100m-1proc-1thread",
                "pretrain-100m-2proc"]
GENERATION_CPU = ["generate-5m-32-true", "generate-5m-32-true-compiled", "generate-5m-bf16-true",
                  "generate-5m-bf16-true-compiled"]
SUITES = {
    "cpu": TRAINING_CPU + GENERATION_CPU + ["help"],
    "gpu": ["pretrain-1b-eager", "pretrain-1b-compiled", "pretrain-1b-fp8", "pretrain-1b-fp8-tensorwise",
            "pretrain-1b-tp2", "pretrain-1b-cp2", "pretrain-1b-pp2", "generate-5m-bf16-true",
            "generate-5m-bf16-true-compiled"],
}
# The 1B cases split over 2 GPUs (compiled, bf16-mixed, the same global batch): skipped on a machine with fewer GPUs.
PARALLEL_1B = {"tp2": ["--parallel.tensor", "2"], "cp2": ["--parallel.context", "2"],
               "pp2": ["--parallel.pipeline", "2"]}
# The ~100M Llama shape of benchmarks/distributed.py (124M parameters with its 32000-row embedding).
MODEL_100M = ["--model_config.n_layer", "12", "--model_config.n_embd", "768", "--model_config.n_head", "12",
              "--model_config.n_query_groups", "4", "--model_config.intermediate_size", "2048",
              "--model_config.padded_vocab_size", "32000", "--model_config.name", "llama-100m"]
OURS_SAMPLE = re.compile(r"^Sample (\d+): (\d+) tokens in ([\d.]+) s")
REF_SAMPLE = re.compile(r"Time for inference (\d+): ([\d.]+) sec total, ([\d.]+) tokens/sec")


# ---- the machine's peak -------------------------------------------------------------------------------------------------
PEAK_CODE = """
import json, sys, time, torch
device = sys.argv[1]
result = {}
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    b = torch.randn(2048, 2048, device=device, dtype=dtype)
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    a @ b; sync()
    best, budget = 0.0, time.perf_counter() + 3
    while time.perf_counter() < budget:
        start = time.perf_counter()
        count = 0
        while count == 0 or time.perf_counter() - start < 0.3:
            a @ b
            count += 1
        sync()
        best = max(best, 2 * 2048**3 * count / (time.perf_counter() - start))
    result[name] = best
print(json.dumps(result))
"""


def matmul_peaks(python: str, device: str, env: dict) -> dict:
    """The best FLOP/s of a 2048^3 matmul in fp32 and bf16 over ~3 s each (the hardware limit MFU is taken against)."""
    out = subprocess.run([python, "-c", PEAK_CODE, device], capture_output=True, text=True, env=env, cwd="/",
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the matmul peak measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def hardware_peak(peaks: dict, dtype: str) -> float:
    """The FLOP/s limit of a run in `dtype`. A CPU without bf16 matrix units (no AVX512-BF16/AMX) multiplies bf16
    slower than fp32, so its limit for bf16-mixed is the faster of the two."""
    return max(peaks["bfloat16"], peaks["float32"]) if dtype == "bfloat16" else peaks["float32"]


def flops_per_token(model_args: dict, seq_length: int, lora: bool) -> float:
    """Training FLOPs per token of the model; for LoRA (r 8 on query and value, as the LoRA
    cases run) only the adapters get weight gradients, counted on the LoRA model itself built on the meta device."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.config import Config
    from litgpt.lora import LoRASettings, add_lora, lora_parameter_count
    from litgpt.model import GPT
    from litgpt.train.metrics import flops_per_token as count

    config = Config(**model_args)
    if not lora:
        return count(config, seq_length)
    with meta_device():
        model = GPT(config)
        add_lora(model, LoRASettings(r=8, query=True, key=False, value=True, projection=False, mlp=False, head=False))
    adapters = lora_parameter_count(model)
    return count(config, seq_length, adapters / sum(p.numel() for p in model.parameters()))


# ---- cases ----------------------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One toolkit's command of a case."""

    toolkit: str
    argv: list[str]
    out_dir: Optional[Path] = None
    files: dict = field(default_factory=dict)


def training_cases(names: list[str], work: Path, python_ours: str, python_ref: Optional[Path],
                   gpu: bool, steps: tuple[int, int] = (10, 150)) -> dict[str, tuple[harness.Case, int, int, dict]]:
    """name -> (the harness's case, warm-up steps, total steps, facts for MFU); `steps` (warm-up, measured) of the
    5M and tiny cases."""
    cases = {}
    for name in names:
        if name.startswith("pretrain-1b"):
            warmup, measured = 3, 8
            total = warmup + measured
            precision = "fp8-mixed" if "-fp8" in name else "bf16-mixed"  # fp8: compiled, as torchtitan runs it
            recipe = ["--train.float8_recipe", "tensorwise"] if name.endswith("tensorwise") else []
            split = PARALLEL_1B.get(name.rsplit("-", 1)[1], [])
            devices = 2 if split else 1
            out = work / "out" / name
            argv = [python_ours, "-m", "litgpt", "pretrain", "Llama-3.2-1B", "--tokenizer_dir", str(harness.TOKENIZER_DIR),
                    "--data", "Tiny", "--data.cache_dir", str(work / "tiny-cache"), "--out_dir", str(out / "ours"),
                    "--train.max_seq_length", "2048", "--train.micro_batch_size", "4", "--train.global_batch_size",
                    "32", "--train.max_steps", str(total), "--train.log_interval", "1", "--train.lr_warmup_steps", "2",
                    "--train.save_interval", "null", "--eval.interval", str(harness.BIG), "--eval.initial_validation",
                    "false", "--eval.final_validation", "false", "--precision", precision, "--devices", str(devices),
                    "--compiler", "none" if name.endswith("eager") else "torch", *recipe, *split]
            command = harness.Command("ours", argv, out / "ours", harness.OURS_STEP)
            from litgpt.config import Config

            config = Config.from_name("Llama-3.2-1B")
            model_args = {k: getattr(config, k) for k in config.__dataclass_fields__}
            cases[name] = (harness.Case(name, "Llama-3.2-1B shape, seq 2048, micro batch 4, global batch 32, "
                                        f"{precision}{' (tensorwise)' if recipe else ''}, {devices} GPU"
                                        + (f"s, {' '.join(split)}" if split else ""),
                                        32 * 2048, command, None), warmup, total,
                           {"model": model_args, "seq": 2048, "lora": False, "dtype": "bfloat16",
                            "processes": devices, "gpus": devices})
            continue
        kind, size, rest = name.split("-", 2)
        precision = rest if rest in PRECISIONS else "32-true"
        warmup, measured = STEPS_100M if size == "100m" else steps
        total = warmup + measured
        base = "llama5m-lora" if kind == "lora" else "tiny" if size == "tiny" else "llama5m-pretrain"
        ref = python_ref if ("proc" not in name) else None  # LitGPT cannot run FSDP on a CPU
        (case,) = harness.build_cases([base], work, ref, None if precision == "default" else precision, total,
                                      python_ours=python_ours)
        case.name = name
        ours = case.ours
        ours.out_dir = work / "out" / name / "ours"
        ours.argv[ours.argv.index("--out_dir") + 1] = str(ours.out_dir)
        if case.ref is not None:
            case.ref.out_dir = work / "out" / name / "litgpt"
            case.ref.argv[case.ref.argv.index("--out_dir") + 1] = str(case.ref.out_dir)
        model = dict(harness.MODEL)
        if "100m" in name:
            # global batch 4 of 256 tokens whatever the number of processes: every variant does the same work.
            # Compiled as LitGPT always is: --compiler auto would leave a run of 23 steps eager (compiling pays from
            # AUTO_COMPILE_MIN_STEPS_CPU steps on), which is not the run a user of this model makes.
            ours.argv += MODEL_100M + ["--train.global_batch_size", "4", "--compiler", "torch"]
            if case.ref is not None:
                case.ref.argv += MODEL_100M
            model.update(n_layer=12, n_embd=768, n_head=12, n_query_groups=4, intermediate_size=2048,
                         padded_vocab_size=32000)
            case.description = ("Llama-shaped 124M (12 layers, 768 wide, GQA 12/4), global batch 4, seq 256; ours "
                                "with --compiler torch (LitGPT always compiles)")
        processes = 2 if "2proc" in name else 1
        if processes == 2:
            strategy = name.rsplit("-", 1)[1] if "5m" in name else "FULL_SHARD"
            ours.argv[ours.argv.index("--devices") + 1] = "2"
            ours.argv += ["--fsdp.sharding_strategy", strategy, "--train.micro_batch_size", "2"]
            if "100m" not in name:
                ours.argv += ["--train.global_batch_size", "4"]
            case.description += f"; 2 processes, {strategy}, micro batch 2 each (same global batch)"
        if name.endswith("1thread"):
            case.description += "; 1 thread: one process on one core, the unit the 2-process run has per rank"
        if precision != "32-true" and precision not in case.description:
            case.description += f"; {precision}" + (" precision of each toolkit" if precision == "default" else "")
        # MFU's peak: bf16 where a default may be bf16-mixed (LitGPT's always is on a CPU; ours where bf16 is native)
        dtype = "float32" if precision == "32-true" else "bfloat16"
        cases[name] = (case, warmup, total, {"model": model, "seq": harness.MODEL["block_size"], "lora": kind == "lora",
                                             "dtype": dtype,
                                             "processes": processes})
    return cases


def generation_variants(name: str, work: Path, python_ours: str, python_ref: Optional[Path],
                        samples: int) -> list[Variant]:
    ours_ckpt, ref_ckpt = harness.write_checkpoints(work, python_ref)
    precision = "bf16-true" if "bf16" in name else "32-true"
    common = ["--prompt", "Once upon a time", "--max_new_tokens", "200", "--num_samples", str(samples),
              "--precision", precision, "--temperature", "0.8", "--top_k", "50"]
    if name.endswith("compiled"):
        common += ["--compile", "true"]
    variants = [Variant("ours", [python_ours, "-m", "litgpt", "generate", str(ours_ckpt), *common])]
    if python_ref is not None:
        variants.append(Variant("litgpt", [str(python_ref), "-m", "litgpt", "generate", str(ref_ckpt), *common]))
    return variants


# ---- running --------------------------------------------------------------------------------------------------------------
def child_env(threads: int, work: Path) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1"})
    return env


def run_generation(variant: Variant, env: dict, work: Path, log_path: Path) -> dict:
    start = time.perf_counter()
    out = subprocess.run(variant.argv, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    text = out.stdout + out.stderr
    log_path.write_text(text)
    rates = {}
    for line in text.splitlines():
        if variant.toolkit == "ours" and (m := OURS_SAMPLE.search(line)):
            rates[int(m.group(1))] = int(m.group(2)) / float(m.group(3))
        elif variant.toolkit == "litgpt" and (m := REF_SAMPLE.search(line)):
            rates[int(m.group(1))] = float(m.group(3))
    result = {"toolkit": variant.toolkit, "returncode": out.returncode, "wall_seconds": round(wall, 1),
              "log": str(log_path)}
    if out.returncode != 0 or len(rates) < 2:
        result["error"] = "\n".join(text.splitlines()[-15:])
        return result
    warm = [rates[i] for i in sorted(rates) if i > 1]
    result.update(value=round(statistics.median(warm), 1), cold_tokens_per_sec=round(rates[1], 1),
                  per_sample_tokens_per_sec=[round(rates[i], 1) for i in sorted(rates)])
    return result


def run_help(variant: Variant, env: dict, work: Path) -> dict:
    start = time.perf_counter()
    out = subprocess.run(variant.argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    result = {"toolkit": variant.toolkit, "returncode": out.returncode}
    if out.returncode != 0 or "usage" not in out.stdout.lower():
        result["error"] = (out.stdout + out.stderr)[-1500:]
        return result
    result["value"] = round(seconds, 3)
    return result


def summarize(runs: list[dict], key: str) -> Optional[dict]:
    values = [r[key] for r in runs if r.get(key) is not None and "error" not in r]
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values), "runs": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=list(SUITES), default="cpu")
    parser.add_argument("--cases", default=None, help="comma-separated subset of the suite's cases")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="5M and tiny training: steps before the measurement")
    parser.add_argument("--steps", type=int, default=150, help="5M and tiny training: steps measured")
    parser.add_argument("--samples", type=int, default=4, help="generation: samples per run (the first is cold)")
    parser.add_argument("--litgpt-venv", type=Path, default=None, help="virtual environment with litgpt==0.5.13")
    parser.add_argument("--ours-venv", type=Path, default=None,
                        help="virtual environment with our litgpt and only its dependencies (default: this Python)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/litgpt-bench"))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--ours-args", default="", help="more flags for our training commands, e.g. "
                        "'--train.loss_chunk_size 8192' (recorded in the case's description and commands)")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before each training run, wait up to this long for a quiet machine")
    args = parser.parse_args()

    names = args.cases.split(",") if args.cases else SUITES[args.suite]
    unknown = [n for n in names if n not in SUITES[args.suite]]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)} for --suite {args.suite}: "
                         f"choose from {', '.join(SUITES[args.suite])}")
    work = args.work_dir.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    python_ours = str(args.ours_venv / "bin" / "python") if args.ours_venv else sys.executable
    python_ref = None
    if args.litgpt_venv is not None:
        python_ref = args.litgpt_venv / "bin" / "python"
        print(f"reference: LitGPT {harness.ref_versions(python_ref)['litgpt']} in {args.litgpt_venv}", flush=True)
    env = child_env(args.threads, work)
    device = "cuda" if args.suite == "gpu" else "cpu"
    info = harness.machine(python_ref)
    info["threads"] = args.threads
    info["ours_python"] = python_ours
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    peaks = matmul_peaks(python_ours, device, env)
    info["matmul_peak_flops"] = peaks
    print(f"measured 2048^3 matmul peak: fp32 {peaks['float32'] / 1e9:,.1f} GFLOP/s, "
          f"bf16 {peaks['bfloat16'] / 1e9:,.1f} GFLOP/s", flush=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    output = args.output or REPO / "benchmarks" / "results" / f"run-{args.suite}-{datetime.date.today()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)

    def write_output() -> None:  # after every case: a run cut short keeps the cases it finished
        output.write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": info,
            "command_line": ["python", "benchmarks/run.py", *sys.argv[1:]], "repeats": args.repeats,
            "order": "ours, litgpt alternating per repeat", "results": results,
        }, indent=1, default=str) + "\n")
    training = training_cases([n for n in names if n.startswith(("pretrain", "lora"))], work, python_ours, python_ref,
                              device == "cuda", (args.warmup, args.steps))
    for case, *_ in training.values():
        if args.ours_args:
            case.ours.argv += shlex.split(args.ours_args)
            case.description += f"; ours with {args.ours_args}"
    results = []
    for name in names:
        record: dict = {"case": name, "runs": {"ours": [], "litgpt": []}}
        if name in training:
            case, warmup, total, facts = training[name]
            fpt = flops_per_token(facts["model"], facts["seq"], facts["lora"])
            record.update(description=case.description, unit="tokens/s", higher_is_better=True,
                          flops_per_token=fpt, commands={c.toolkit: {"argv": c.argv, "config_files": c.files}
                                                         for c in (case.ours, case.ref) if c is not None})
            gpus = torch.cuda.device_count() if device == "cuda" else 0
            if facts.get("gpus", 0) > gpus:
                record["skipped"] = f"needs {facts['gpus']} GPUs, this machine has {gpus}"
                print(f"{name}: skipped: {record['skipped']}", flush=True)
            for repeat in range(args.repeats if "skipped" not in record else 0):
                for command in (case.ours, case.ref):
                    if command is None:
                        continue
                    harness.wait_until_idle(0.15, args.wait_idle)
                    log = work / "logs" / f"{stamp}-{name}-{command.toolkit}-{repeat}.log"
                    # the machine's threads split between the processes, as each would have its own device
                    threads = 1 if name.endswith("1thread") else max(1, args.threads // facts["processes"])
                    run = harness.run_command(command, case, warmup, total, threads, work, log, 3600)
                    run["threads_per_process"] = threads
                    if "tokens_per_sec" in run:
                        run["value"] = run["tokens_per_sec"]
                        run["mfu_vs_measured_peak"] = round(fpt * run["value"] / hardware_peak(peaks, facts["dtype"]), 4)
                        if device == "cuda":
                            metrics = json.loads((command.out_dir / "metrics.json").read_text())
                            run["peak_memory_mb"] = metrics["peak_memory_mb"]
                            run["mfu_vs_datasheet"] = round(fpt * run["value"] / metrics["peak_flops_per_device"], 4)
                    record["runs"][command.toolkit].append(run)
                    say(name, run, "tokens/s")
        else:
            if name == "help":
                ours_cli = str(Path(python_ours).parent / "litgpt")
                variants = [Variant("ours", [ours_cli, "--help"])]
                if python_ref is not None:
                    variants.append(Variant("litgpt", [str(python_ref.parent / "litgpt"), "--help"]))
                record.update(description="`litgpt --help` wall time (console script)", unit="s",
                              higher_is_better=False)
            else:
                variants = generation_variants(name, work, python_ours, python_ref, args.samples)
                record.update(description="200 new tokens from the 5M model, KV cache, top-k 50, temperature 0.8, "
                                          f"{variants[0].argv[variants[0].argv.index('--precision') + 1]}"
                                          + (", --compile true" if name.endswith("compiled") else ""),
                              unit="tokens/s (warm samples)", higher_is_better=True)
            record["commands"] = {v.toolkit: {"argv": v.argv} for v in variants}
            for repeat in range(max(args.repeats, 5) if name == "help" else args.repeats):
                for variant in variants:
                    if name == "help":
                        run = run_help(variant, env, work)
                    else:
                        run = run_generation(variant, env, work,
                                             work / "logs" / f"{stamp}-{name}-{variant.toolkit}-{repeat}.log")
                    record["runs"][variant.toolkit].append(run)
                    say(name, run, record["unit"])
        record["summary"] = {toolkit: summarize(runs, "value") for toolkit, runs in record["runs"].items()}
        for toolkit in ("ours", "litgpt"):
            record["summary"][f"{toolkit}_peak_rss_mb"] = summarize(record["runs"][toolkit], "peak_rss_mb")
            record["summary"][f"{toolkit}_mfu"] = summarize(record["runs"][toolkit], "mfu_vs_measured_peak")
        results.append(record)
        write_output()
    info["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print_table(results, info)
    write_output()
    print(f"\nwrote {output}")


def say(name: str, run: dict, unit: str) -> None:
    if "error" in run:
        print(f"{name} {run['toolkit']}: FAILED\n{run['error']}", flush=True)
    else:
        extra = f", peak RSS {run['peak_rss_mb']:,.0f} MB" if run.get("peak_rss_mb") else ""
        print(f"{name:<34} {run['toolkit']:<6} {run['value']:>10,.2f} {unit}{extra}", flush=True)


def print_table(results: list[dict], info: dict) -> None:
    print(f"\n{info['cpu']}, {info['usable_cores']} cores, {info['threads']} threads, torch {info['torch']}"
          + (f", {info['gpu']}" if info.get("gpu") else ""))
    header = f"{'case':<34} {'ours':>10} {'min-max':>17} {'LitGPT':>10} {'min-max':>17} {'ratio':>6} {'MFU':>6} " \
             f"{'RSS MB ours/LitGPT':>19}"
    print(header)
    print("-" * len(header))
    for record in results:
        summary = record["summary"]
        ours, ref = summary.get("ours"), summary.get("litgpt")

        def cell(s):
            return (f"{s['median']:>10,.2f} {s['min']:>8,.2f}-{s['max']:<8,.2f}" if s else f"{'-':>10} {'':>17}")

        ratio = ""
        if ours and ref:
            value = ours["median"] / ref["median"] if record["higher_is_better"] else ref["median"] / ours["median"]
            ratio = f"{value:.2f}x"
        mfu = summary.get("ours_mfu")
        rss = [summary.get("ours_peak_rss_mb"), summary.get("litgpt_peak_rss_mb")]
        rss_text = "/".join(f"{r['median']:,.0f}" for r in rss if r)
        print(f"{record['case']:<34} {cell(ours)} {cell(ref)} {ratio:>6} "
              f"{(format(mfu['median'], '.1%') if mfu else ''):>6} {rss_text:>19}")


if __name__ == "__main__":
    main()
