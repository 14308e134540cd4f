"""Training throughput and peak memory of our `litgpt pretrain` / `litgpt finetune_lora`, side by side with LitGPT.

Each case runs `--repeats` times, alternating our command and the reference toolkit's (LitGPT 0.5.13, installed in a
separate virtual environment given with `--litgpt-venv`): ours, LitGPT, ours, LitGPT, ... so both see the same machine
state. Every run is a child process of this script, measured the same way for both toolkits:

* tokens/s (steady state): this script timestamps each per-step log line as the child prints it (stdout unbuffered,
  `--train.log_interval 1`); tokens/s = tokens per step x (N - W) / (time of step N's line - time of step W's line),
  i.e. the first W (`--warmup`, default 5) steps -- torch.compile, allocator and cache warm-up -- are left out.
* peak memory: the child's VmHWM (peak resident set) from /proc/<pid>/status, read when the line of the last
  measured step arrives ("training peak") and sampled until it exits ("whole run", which also covers the final
  checkpoint and, for LoRA, the merge). Only the training process itself; inductor's compile workers are not counted.
* CPU time of the child over the measured window and the share of the machine's CPU time taken by other processes
  in the same window ("other load"), to tell a slow run from a busy machine.

Cases (all: single process, `--devices 1`, same thread count via OMP_NUM_THREADS, same precision, no validation,
sampling or checkpoint inside the measured window):

* tiny              our bundled recipe config_hub/pretrain/tiny.yaml (bundled story corpus, micro batch 8, seq 256);
                    LitGPT: the same model, optimizer, batch and the same stories as TextFiles.
* llama5m-pretrain  the Llama-shaped 5M model (4 layers, n_embd 256, 4 heads / 2 KV groups, vocab 4096,
                    intermediate 688), micro batch 4 = global batch, seq 256, TextFiles over the same story files.
* llama5m-lora      LoRA (r 8, alpha 16, dropout 0.05, query + value) on a random checkpoint of that model (the same
                    weights for both), micro batch 4, seq 256, the same JSON instruction set (every sample is longer
                    than 256 tokens, so every batch is exactly 4 x 256 tokens for both).

    python benchmarks/train.py --litgpt-venv /tmp/litgpt-ref
    python benchmarks/train.py --cases llama5m-pretrain --repeats 1 --precision bf16-mixed --steps 2 --warmup 1

Setting up the reference environment (its TextFiles needs litdata, whose torchvision requirement would pull another
torch, hence --no-deps):

    python -m venv /tmp/litgpt-ref && /tmp/litgpt-ref/bin/pip install torch==2.13.0 litgpt==0.5.13
    /tmp/litgpt-ref/bin/pip install --no-deps litdata && /tmp/litgpt-ref/bin/pip install boto3 requests
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "config_hub" / "pretrain" / "tiny.yaml"
TINY_DIR = REPO / "litgpt" / "data" / "tiny"
TOKENIZER_DIR = TINY_DIR / "tokenizer"
CASES = ("tiny", "llama5m-pretrain", "llama5m-lora")
BIG = 1_000_000  # an interval no run reaches (validation, checkpoints)

# The Llama-shaped ~5M model, in our Config's field names (the same as the tiny recipe's model).
MODEL = {
    "name": "tiny-llama-5m", "block_size": 256, "vocab_size": 4096, "padded_vocab_size": 4096, "n_layer": 4,
    "n_embd": 256, "n_head": 4, "n_query_groups": 2, "intermediate_size": 688, "norm_class_name": "RMSNorm",
    "norm_eps": 1.0e-05, "mlp_class_name": "LLaMAMLP", "rope_base": 10000.0, "bias": False,
    "parallel_residual": False, "rotary_percentage": 1.0,
}
# LitGPT's Config defaults differ from ours for GPT-NeoX-style fields, so the reference config states them all.
REF_MODEL = dict(MODEL, rope_base=10000)  # LitGPT's Config types rope_base as int
OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3.0e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}}

OURS_STEP = re.compile(r"^step (\d+)/(\d+) \|")
REF_STEP = re.compile(r"\| iter (\d+) step (\d+) \|")
REF_ITER_TIME = re.compile(r"iter time: ([\d.]+) ms")


# ---- the machine ----------------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def machine(python_ref: Optional[Path]) -> dict:
    import torch

    flags = cpu_flags()
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cpu_flags": sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ours": package_version("litgpt"),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    if python_ref is not None:
        info["reference"] = ref_versions(python_ref)
    return info


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def ref_versions(python_ref: Path) -> dict:
    code = (
        "import json, torch, litgpt, litdata, lightning; from importlib.metadata import version; "
        "print(json.dumps({'litgpt': version('litgpt'), 'torch': torch.__version__, "
        "'lightning': lightning.__version__, 'litdata': version('litdata')}))"
    )
    out = subprocess.run([str(python_ref), "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- inputs: text files, an instruction set, checkpoints, configs -------------------------------------------------------
def stories(path: Path) -> list[str]:
    from litgpt.data.text_files import blank_line_documents

    return list(blank_line_documents(path))


def write_text_folders(root: Path, per_file: int = 100) -> None:
    """The bundled stories as folders of .txt files (train: 100 stories a file; val: one file)."""
    if (root / "done").is_file():
        return
    if root.exists():
        shutil.rmtree(root)
    train, val = stories(TINY_DIR / "train.txt"), stories(TINY_DIR / "val.txt")
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir(parents=True)
    for start in range(0, len(train), per_file):
        (root / "train" / f"part-{start // per_file:04d}.txt").write_text("\n\n".join(train[start:start + per_file]) + "\n")
    (root / "val" / "part-0000.txt").write_text("\n\n".join(val) + "\n")
    (root / "done").write_text("")


def write_instruction_set(root: Path, num_train: int = 400, num_val: int = 8) -> None:
    """Instruction records made of the stories, each over 256 tokens long (so batches are exactly 4 x 256)."""
    if (root / "done").is_file():
        return
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    texts = stories(TINY_DIR / "train.txt")
    records, i = [], 0
    while len(records) < num_train + num_val:
        first, rest = texts[i].split("\n", 1) if "\n" in texts[i] else (texts[i], "")
        output = "\n".join([rest] + texts[i + 1:i + 4]).strip()
        i += 4
        record = {"instruction": "Continue the story.", "input": first, "output": output}
        if len(tokenizer.encode(output).ids) > 300:
            records.append(record)
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.json").write_text(json.dumps(records[:num_train], indent=1))
    (root / "val.json").write_text(json.dumps(records[num_train:], indent=1))
    (root / "done").write_text("")


REF_CHECKPOINT = """
import sys, torch, yaml
from pathlib import Path
from litgpt import GPT, Config
from litgpt.utils import save_config
folder = Path(sys.argv[1])
config = Config(**yaml.safe_load(Path(sys.argv[2]).read_text()))
torch.manual_seed(0)
model = GPT(config)
torch.save(model.state_dict(), folder / "lit_model.pth")
save_config(config, folder)
"""


def write_checkpoints(work: Path, python_ref: Optional[Path]) -> tuple[Path, Optional[Path]]:
    """A random checkpoint of the 5M model in LitGPT's format (saved by LitGPT's own GPT in its venv) and the same
    weights in ours (the key names are the same for Llama-shaped models; model_config.yaml is written by our Config)."""
    import torch

    from litgpt.config import Config

    ours, ref = work / "checkpoint" / "ours", work / "checkpoint" / "litgpt"
    fields = dict(MODEL)
    if python_ref is not None and not (ref / "lit_model.pth").is_file():
        ref.mkdir(parents=True, exist_ok=True)
        (work / "ref-model.yaml").write_text(dump_yaml(REF_MODEL))
        script = work / "make_ref_checkpoint.py"
        script.write_text(REF_CHECKPOINT)
        subprocess.run([str(python_ref), str(script), str(ref), str(work / "ref-model.yaml")], check=True, cwd=work)
        copy_tokenizer(ref)
    if not (ours / "lit_model.pth").is_file():
        ours.mkdir(parents=True, exist_ok=True)
        if python_ref is not None:
            shutil.copy(ref / "lit_model.pth", ours / "lit_model.pth")
        else:
            from litgpt.model import GPT

            torch.manual_seed(0)
            torch.save(GPT(Config(**fields)).state_dict(), ours / "lit_model.pth")
        Config(**fields).save(ours / "model_config.yaml")
        copy_tokenizer(ours)
    return ours, (ref if python_ref is not None else None)


def copy_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)


def dump_yaml(value: dict) -> str:
    import yaml

    return yaml.safe_dump(value, sort_keys=False)


# ---- the cases ------------------------------------------------------------------------------------------------------------
@dataclass
class Command:
    toolkit: str  # "ours" or "litgpt"
    argv: list[str]
    out_dir: Path
    step_pattern: re.Pattern
    files: dict = field(default_factory=dict)  # config files the command reads: name -> text


@dataclass
class Case:
    name: str
    description: str
    tokens_per_step: int
    ours: Command
    ref: Optional[Command]


def build_cases(names: list[str], work: Path, python_ref: Optional[Path], precision: Optional[str], total_steps: int,
                python_ours: str = sys.executable) -> list[Case]:
    """The cases' commands and input files; `python_ours` is the interpreter that runs our `litgpt`. `precision`
    None leaves --precision out: each toolkit's own default."""
    common_train = ["--train.log_interval", "1", "--devices", "1", "--logger_name", "csv"]
    if precision is not None:
        common_train += ["--precision", precision]
    ours_python = [python_ours, "-m", "litgpt"]
    ref_python = [str(python_ref), "-m", "litgpt"] if python_ref is not None else None
    cases = []
    for name in names:
        out = work / "out" / name
        if name in ("tiny", "llama5m-pretrain"):
            write_text_folders(work / "text-ours")
            if python_ref is not None:
                write_text_folders(work / "text-litgpt")
            micro = 8 if name == "tiny" else 4
            tokens = micro * MODEL["block_size"]
            if name == "tiny":
                ours_config, ours_files = TINY_RECIPE, {}
            else:
                ours_config = work / "ours-llama5m-pretrain.yaml"
                ours_files = {ours_config.name: dump_yaml({
                    "model_config": dict(MODEL),
                    "data": {"class_path": "litgpt.data.TextFiles", "init_args": {
                        "train_data_path": str(work / "text-ours" / "train"),
                        "val_data_path": str(work / "text-ours" / "val")}},
                    "tokenizer_dir": str(TOKENIZER_DIR),
                    "train": {"global_batch_size": micro, "micro_batch_size": micro, "lr_warmup_steps": 30,
                              "max_norm": 1.0, "min_lr": 3.0e-4},
                    "optimizer": OPTIMIZER,
                    "seed": 42,
                })}
            ours = Command("ours", ours_python + [
                "pretrain", "--config", str(ours_config),
                "--train.max_steps", str(total_steps), "--train.save_interval", "null",
                "--eval.interval", str(BIG), "--eval.initial_validation", "false", "--eval.final_validation", "false",
                *common_train, "--out_dir", str(out / "ours"),
            ], out / "ours", OURS_STEP, ours_files)
            ref = None
            if ref_python is not None:
                ref_config = work / f"litgpt-{name}.yaml"
                ref_files = {ref_config.name: dump_yaml({
                    "model_name": "tiny-llama-5m",  # required by LitGPT's CLI; model_config overrides it
                    "model_config": REF_MODEL,
                    "data": {"class_path": "litgpt.data.TextFiles", "init_args": {
                        "train_data_path": str(work / "text-litgpt" / "train"),
                        "val_data_path": str(work / "text-litgpt" / "val"), "num_workers": 0}},
                    "tokenizer_dir": str(TOKENIZER_DIR),
                    "train": {"global_batch_size": micro, "micro_batch_size": micro, "lr_warmup_steps": 30,
                              "max_norm": 1.0, "min_lr": 3.0e-4},
                    "optimizer": OPTIMIZER,
                    "seed": 42,
                })}
                ref = Command("litgpt", ref_python + [
                    "pretrain", "--config", str(ref_config),
                    # LitGPT's pretrain stops on max_tokens (it ignores max_steps): exactly total_steps steps
                    "--train.max_tokens", str(total_steps * tokens), "--train.save_interval", str(BIG),
                    "--eval.interval", str(BIG), "--eval.initial_validation", "false", "--eval.final_validation", "false",
                    *common_train, "--out_dir", str(out / "litgpt"),
                ], out / "litgpt", REF_STEP, ref_files)
            description = (
                "bundled recipe config_hub/pretrain/tiny.yaml (Tiny stories, micro batch 8 = global, seq 256)"
                if name == "tiny" else "Llama-shaped 5M, TextFiles (the bundled stories), micro batch 4 = global, seq 256"
            )
            cases.append(Case(name, description, tokens, ours, ref))
        elif name == "llama5m-lora":
            write_instruction_set(work / "sft-ours")
            if python_ref is not None:
                write_instruction_set(work / "sft-litgpt")
            ours_ckpt, ref_ckpt = write_checkpoints(work, python_ref)
            micro = 4
            tokens = micro * MODEL["block_size"]
            lora = ["--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05", "--lora_query", "true",
                    "--lora_key", "false", "--lora_value", "true", "--lora_projection", "false", "--lora_mlp", "false",
                    "--lora_head", "false"]
            train = ["--train.micro_batch_size", str(micro), "--train.global_batch_size", str(micro),
                     "--train.max_seq_length", "256", "--train.max_steps", str(total_steps), "--train.epochs", "5",
                     "--train.lr_warmup_steps", "10",
                     "--eval.interval", str(BIG), "--eval.initial_validation", "false", "--eval.final_validation", "false"]
            ours = Command("ours", ours_python + [
                "finetune_lora", str(ours_ckpt), "--data", "JSON", "--data.json_path", str(work / "sft-ours"),
                "--data.prompt_style", "alpaca", "--data.mask_prompt", "false", *lora, *train,
                "--train.save_interval", "null", "--seed", "1337", *common_train, "--out_dir", str(out / "ours"),
            ], out / "ours", OURS_STEP)
            ref = None
            if ref_python is not None:
                ref = Command("litgpt", ref_python + [
                    "finetune_lora", str(ref_ckpt), "--data", "JSON", "--data.json_path", str(work / "sft-litgpt"),
                    "--data.prompt_style", "alpaca", "--data.mask_prompt", "false", "--data.num_workers", "0", *lora,
                    *train, "--train.save_interval", str(BIG), "--seed", "1337", *common_train,
                    "--out_dir", str(out / "litgpt"),
                ], out / "litgpt", REF_STEP)
            cases.append(Case(name, "LoRA r8 (query, value) on the 5M model, JSON instructions, micro batch 4, seq 256",
                              tokens, ours, ref))
        else:
            raise SystemExit(f"unknown case {name!r}: choose from {', '.join(CASES)}")
    for case in cases:
        for command in (case.ours, case.ref):
            if command is not None:
                for file_name, text in command.files.items():
                    (work / file_name).write_text(text)
    return cases


# ---- running and measuring one command ----------------------------------------------------------------------------------
def read_status_kb(pid: int, key: str) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def process_cpu_seconds(pid: int) -> Optional[float]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores together."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def busy_share(seconds: float = 2.0) -> float:
    """The share of the machine's CPU time in use (by anything) over the next `seconds`."""
    busy0, total0 = machine_cpu_seconds()
    time.sleep(seconds)
    busy1, total1 = machine_cpu_seconds()
    return (busy1 - busy0) / max(total1 - total0, 1e-9)


def wait_until_idle(threshold: float, max_wait: float) -> tuple[float, float]:
    """Wait (at most `max_wait` seconds) until other processes use less than `threshold` of the CPUs; returns the last
    busy share seen and the seconds waited."""
    start = time.perf_counter()
    share = busy_share()
    while share > threshold and time.perf_counter() - start < max_wait:
        share = busy_share(5.0)
    return share, time.perf_counter() - start


def read_output(child, command: Command, start: float, timeout: float, log_path: Path, lines: list, steps: dict,
                iter_times: dict) -> None:
    """Timestamp the child's lines as they come; at each step line note its CPU time, VmHWM and the machine's."""
    with open(log_path, "w") as log:
        for line in child.stdout:
            now = time.perf_counter()
            lines.append(line)
            log.write(f"{now - start:9.3f} {line}")
            match = command.step_pattern.search(line)
            if match:
                step = int(match.group(1))
                busy, total = machine_cpu_seconds()
                steps[step] = {"t": now - start, "cpu": process_cpu_seconds(child.pid), "hwm_kb":
                               read_status_kb(child.pid, "VmHWM"), "machine_busy": busy, "machine_total": total}
                found = REF_ITER_TIME.search(line)
                if found:
                    iter_times[step] = float(found.group(1)) / 1000
            if now - start > timeout:
                child.kill()


def run_command(command: Command, case: Case, warmup: int, total_steps: int, threads: int, work: Path,
                log_path: Path, timeout: float) -> dict:
    if command.out_dir.exists():
        shutil.rmtree(command.out_dir)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if command.toolkit == "ours":
        env["PYTHONPATH"] = str(REPO)  # this checkout, whichever interpreter (or its editable install) runs it
    env.update({
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"), "TOKENIZERS_PARALLELISM": "false",
    })
    start = time.perf_counter()
    # cwd = the work folder, never the repository: `python -m litgpt` would import our package in LitGPT's venv
    child = subprocess.Popen(command.argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1)
    steps: dict[int, dict] = {}
    iter_times: dict[int, float] = {}
    peak_kb = 0
    lines: list[str] = []

    def sample() -> None:
        nonlocal peak_kb
        while child.poll() is None:
            value = read_status_kb(child.pid, "VmHWM")
            if value is not None:
                peak_kb = max(peak_kb, value)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        read_output(child, command, start, timeout, log_path, lines, steps, iter_times)
    finally:
        if child.poll() is None:  # interrupted: leave no training process behind
            child.kill()
    child.wait()
    sampler.join()
    wall = time.perf_counter() - start
    result = {"toolkit": command.toolkit, "returncode": child.returncode, "wall_seconds": round(wall, 1),
              "log": str(log_path), "peak_rss_mb_whole_run": round(peak_kb / 1024, 1)}
    if child.returncode != 0 or total_steps not in steps or warmup not in steps:
        result["error"] = "".join(lines[-15:])
        return result
    first, last = steps[warmup], steps[total_steps]
    seconds = last["t"] - first["t"]
    measured = total_steps - warmup
    cpu = (last["cpu"] or 0) - (first["cpu"] or 0)
    busy = last["machine_busy"] - first["machine_busy"]
    capacity = last["machine_total"] - first["machine_total"]
    step_seconds = [steps[s]["t"] - steps[s - 1]["t"] for s in range(warmup + 1, total_steps + 1)]
    result.update({
        "tokens_per_sec": round(case.tokens_per_step * measured / seconds, 1),
        "measured_steps": measured,
        "measured_seconds": round(seconds, 2),
        "median_step_seconds": round(statistics.median(step_seconds), 4),
        "tokens_per_cpu_second": round(case.tokens_per_step * measured / cpu, 1) if cpu > 0 else None,
        "child_cpu_utilization": round(cpu / seconds, 2),
        "other_load": round(max(0.0, busy - cpu) / capacity, 3) if capacity > 0 else None,
        "peak_rss_mb": round(last["hwm_kb"] / 1024, 1) if last["hwm_kb"] else None,
        "seconds_to_first_step": round(steps[min(steps)]["t"], 1),  # start-up, data, (compile), first step
    })
    # What each toolkit reports itself (not used for the comparison: they measure differently).
    if command.toolkit == "ours":
        metrics_path = command.out_dir / "metrics.json"
        if metrics_path.is_file():
            metrics = json.loads(metrics_path.read_text())
            result["self_reported"] = {k: metrics.get(k) for k in ("tokens_per_sec", "train_seconds", "peak_memory_mb")}
    elif iter_times:
        window = [iter_times[s] for s in range(warmup + 1, total_steps + 1) if s in iter_times]
        if window:
            result["self_reported"] = {
                "tokens_per_sec_from_iter_time": round(case.tokens_per_step * len(window) / sum(window), 1),
                "first_iter_seconds": iter_times.get(1),
            }
    return result


# ---- the report -----------------------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> Optional[dict]:
    good = [r for r in runs if "tokens_per_sec" in r]
    if not good:
        return None
    rates = [r["tokens_per_sec"] for r in good]
    peaks = [r["peak_rss_mb"] for r in good if r.get("peak_rss_mb")]
    cpu_rates = [r["tokens_per_cpu_second"] for r in good if r.get("tokens_per_cpu_second")]
    return {
        "runs": len(good),
        "median_tokens_per_sec": round(statistics.median(rates), 1),
        "min_tokens_per_sec": min(rates),
        "max_tokens_per_sec": max(rates),
        "median_tokens_per_cpu_second": round(statistics.median(cpu_rates), 1) if cpu_rates else None,
        "median_peak_rss_mb": round(statistics.median(peaks), 1) if peaks else None,
        "median_peak_rss_mb_whole_run": round(statistics.median(r["peak_rss_mb_whole_run"] for r in good), 1),
        "max_other_load": max((r["other_load"] or 0) for r in good),
        "seconds_to_first_step": [r["seconds_to_first_step"] for r in good],
    }


def print_table(results: list[dict]) -> None:
    header = (f"{'case':<17} {'toolkit':<7} {'tokens/s':>9} {'min-max':>13} {'tok/CPU-s':>9} {'peak RSS MB':>11} "
              f"{'ours/LitGPT':>11} {'other load':>10}")
    print(header)
    print("-" * len(header))
    for case in results:
        ours, ref = case["summary"].get("ours"), case["summary"].get("litgpt")
        for toolkit, summary in (("ours", ours), ("litgpt", ref)):
            if summary is None:
                if toolkit == "ours" or case.get("litgpt_runs"):
                    print(f"{case['case']:<17} {toolkit:<7} {'failed':>9}")
                continue
            ratio = ""
            if toolkit == "ours" and ref is not None:
                ratio = f"{summary['median_tokens_per_sec'] / ref['median_tokens_per_sec']:.2f}x"
            spread = f"{summary['min_tokens_per_sec']:,.0f}-{summary['max_tokens_per_sec']:,.0f}"
            per_cpu = summary["median_tokens_per_cpu_second"]
            print(f"{case['case']:<17} {toolkit:<7} {summary['median_tokens_per_sec']:>9,.0f} {spread:>13} "
                  f"{per_cpu if per_cpu is None else format(per_cpu, ',.0f'):>9} "
                  f"{summary['median_peak_rss_mb']:>11,.0f} {ratio:>11} {summary['max_other_load']:>10.0%}")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the cleanup that kills the training child
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--litgpt-venv", type=Path, default=None, help="virtual environment with litgpt==0.5.13")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run (after the warm-up steps)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the measurement")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OMP_NUM_THREADS of both")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/litgpt-train-bench"),
                        help="inputs, outputs, logs and the inductor cache (kept between invocations)")
    parser.add_argument("--output", type=Path, default=None, help="default: benchmarks/results/train-<date>.json")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before each run, wait up to this long for other processes to leave the CPUs alone")
    parser.add_argument("--max-other-load", type=float, default=1.0,
                        help="run again (see --retries) when other processes took more than this share of the CPUs")
    parser.add_argument("--retries", type=int, default=0, help="re-runs allowed per run for --max-other-load")
    parser.add_argument("--idle-threshold", type=float, default=0.15,
                        help="the machine counts as idle below this busy share (with --wait-idle)")
    args = parser.parse_args()

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    python_ref = None
    if args.litgpt_venv is not None:
        candidate = args.litgpt_venv / "bin" / "python"
        try:
            versions = ref_versions(candidate)
            python_ref = candidate
            print(f"reference: LitGPT {versions['litgpt']} (torch {versions['torch']}) in {args.litgpt_venv}")
        except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as error:
            print(f"reference environment {args.litgpt_venv} does not work ({error}); measuring ours only",
                  file=sys.stderr)
    total_steps = args.warmup + args.steps
    info = machine(python_ref)
    cases = build_cases(names, work, python_ref, args.precision, total_steps)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    results, discarded = [], []
    started = time.perf_counter()
    for case in cases:
        runs = {"ours": [], "litgpt": []}
        for repeat in range(args.repeats):
            for command in (case.ours, case.ref):  # A B A B
                if command is None:
                    continue
                log_path = work / "logs" / f"{stamp}-{case.name}-{command.toolkit}-{repeat}.log"
                for attempt in range(args.retries + 1):
                    busy_before, waited = wait_until_idle(args.idle_threshold, args.wait_idle)
                    result = run_command(command, case, args.warmup, total_steps, args.threads, work, log_path,
                                         args.timeout)
                    result.update(repeat=repeat, attempt=attempt, busy_before=round(busy_before, 2),
                                  waited_for_idle_seconds=round(waited))
                    if (result.get("other_load") or 0) <= args.max_other_load or attempt == args.retries:
                        break
                    print(f"[{time.perf_counter() - started:6.0f}s] {case.name} {command.toolkit} #{repeat}: other "
                          f"processes took {result['other_load']:.0%} of the CPUs "
                          f"({result['tokens_per_sec']:,.0f} tokens/s); running it again", flush=True)
                    discarded.append(dict(result, case=case.name))
                runs[command.toolkit].append(result)
                if "tokens_per_sec" in result:
                    print(f"[{time.perf_counter() - started:6.0f}s] {case.name:<17} {command.toolkit:<6} #{repeat}: "
                          f"{result['tokens_per_sec']:,.0f} tokens/s, peak RSS {result['peak_rss_mb']:,.0f} MB, "
                          f"first step after {result['seconds_to_first_step']:.0f} s, other load "
                          f"{result['other_load']:.0%}", flush=True)
                else:
                    print(f"[{time.perf_counter() - started:6.0f}s] {case.name} {command.toolkit} #{repeat} FAILED "
                          f"(exit {result['returncode']}), see {log_path}:\n{result.get('error', '')}", flush=True)
        results.append({
            "case": case.name,
            "description": case.description,
            "tokens_per_step": case.tokens_per_step,
            "commands": {c.toolkit: {"argv": c.argv, "config_files": c.files}
                         for c in (case.ours, case.ref) if c is not None},
            "ours_runs": runs["ours"],
            "litgpt_runs": runs["litgpt"],
            "summary": {"ours": summarize(runs["ours"]), "litgpt": summarize(runs["litgpt"])},
        })
    info["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print()
    print(f"{info['cpu']}, {info['usable_cores']} cores, torch {info['torch']}, precision {args.precision}, "
          f"{args.threads} threads, {args.steps} measured steps after {args.warmup} warm-up steps, "
          f"median of {args.repeats} runs")
    print_table(results)
    output = args.output or REPO / "benchmarks" / "results" / f"train-{datetime.date.today().isoformat()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": info,
        "settings": {"cases": names, "repeats": args.repeats, "wait_idle": args.wait_idle,
                     "idle_threshold": args.idle_threshold, "precision": args.precision, "measured_steps": args.steps,
                     "warmup_steps": args.warmup, "threads": args.threads, "order": "ours, litgpt alternating per repeat",
                     "command_line": [Path(sys.argv[0]).name, *sys.argv[1:]]},
        "method": {
            "tokens_per_sec": "tokens per step x (N - W) / (arrival time of step N's log line - step W's), W warm-up "
                              "steps left out; timestamps taken by this script as the child prints (unbuffered)",
            "peak_rss_mb": "VmHWM of the training process (/proc/<pid>/status) when step N's line arrives",
            "peak_rss_mb_whole_run": "VmHWM sampled every 20 ms until the process exits (final save, LoRA merge)",
            "tokens_per_cpu_second": "tokens of the measured steps / CPU seconds (user+sys) of the process in them",
            "other_load": "share of the machine's CPU time in the window used by other processes",
        },
        "results": results,
        "discarded_busy_runs": discarded,
    }
    output.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"\nwrote {output}")


if __name__ == "__main__":
    main()
