"""Preference optimization: pairs/s and peak memory of `litgpt dpo` beside TRL's `DPOTrainer`, on the same CPU, the
same model (a random Llama of the 5M shape, saved by transformers and converted to litgpt, so both start from the
same weights), the same pairs and the same batches.

The pairs: a prompt of `--prompt-words` words and two answers of `--answer-words` words, each word one token of the
bundled tokenizer, so every sequence has the same length on both sides and a step trains the same tokens. Both sides
run float32 (TRL: bf16=False), sigmoid DPO with beta 0.1, AdamW, one micro-batch per step of `--batch` pairs, no
validation or checkpoint inside the measured steps; the reference is each side's own (LoRA: the base with the
adapters off; full: a frozen copy). Each run is its own child process, which reports its own peak RSS (maxrss); the
cases alternate litgpt and TRL (A B A B) so that both see the same load. Time: steps 2..N (the first pays set-up):
litgpt's own per-step log, TRL's step-end callback.

    python benchmarks/dpo.py --method lora --repeats 2 --steps 20 --output benchmarks/results/dpo-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "litgpt" / "data" / "tiny" / "tokenizer"
# The 5M Llama shape of benchmarks/train.py, as a transformers config
HF_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=688, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=1)
WORDS = ["red", "blue", "green", "yellow", "orange", "white", "black", "pink", "dog", "cat", "horse", "mouse", "bird",
         "fish", "goat", "frog"]

TRL_RUN = r"""
import json, sys, time
import datasets, torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
import trl

args = json.loads(sys.argv[1])
torch.manual_seed(0)
tokenizer = PreTrainedTokenizerFast(tokenizer_file=args["tokenizer"], bos_token="<s>", eos_token="</s>",
                                    pad_token="</s>")
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
rows = datasets.Dataset.from_list([json.loads(line) for line in open(args["data"])])
peft_config = None
if args["method"] == "lora":
    from peft import LoraConfig
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")
times = []

class StepTimes(TrainerCallback):
    def on_step_end(self, *_, **__):
        times.append(time.perf_counter())

config = trl.DPOConfig(output_dir=args["out"], per_device_train_batch_size=args["batch"], gradient_accumulation_steps=1,
                       max_steps=args["steps"], learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
                       beta=0.1, loss_type=["sigmoid"], bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                       logging_steps=1000, dataloader_num_workers=0, max_length=None, seed=0)
trainer = trl.DPOTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[StepTimes()])
trainer.train()
import resource
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": times[-1] - times[0], "steps": len(times) - 1, "peak_mb": peak_mb}))
"""


def make_model(folder: Path) -> Path:
    """A random transformers Llama of the 5M shape, saved and converted to litgpt in the same folder."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF_MODEL)).save_pretrained(folder)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy2(file, folder / file.name)
    convert_hf_checkpoint(folder)
    return folder


def write_pairs(path: Path, count: int, prompt_words: int, answer_words: int) -> Path:
    """Pairs of fixed token lengths: every word is one token of the bundled tokenizer."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            words = lambda n: "".join(f" {rng.choice(WORDS)}" for _ in range(n))  # noqa: E731
            f.write(json.dumps({"prompt": words(prompt_words).strip(), "chosen": words(answer_words),
                                "rejected": words(answer_words)}) + "\n")
    return path


def run_litgpt(model: Path, data: Path, out: Path, method: str, batch: int, steps: int) -> dict:
    args = [sys.executable, "-m", "litgpt", "dpo", str(model), "--method", method, "--data", "Preference",
            "--data.json_path", str(data), "--data.prompt_style", "default", "--data.val_split_fraction", "0.05",
            "--out_dir", str(out), "--precision", "32-true", "--devices", "1", "--train.micro_batch_size", str(batch),
            "--train.global_batch_size", str(batch), "--train.max_steps", str(steps), "--train.max_seq_length", "512",
            "--train.lr_warmup_steps", "0", "--train.log_interval", "1", "--train.save_interval", "1000000",
            "--eval.interval", "1000000", "--eval.final_validation", "false", "--eval.max_new_tokens", "0",
            "--lora_dropout", "0", "--optimizer.lr", "1e-4"]
    rows = litgpt_step_rows(args, out, "litgpt dpo")
    step_seconds = [step_tokens(rows, i) / float(row["tokens_per_sec"]) for i, row in enumerate(rows)]
    peak_mb = json.loads(out.joinpath("metrics.json").read_text())["peak_memory_mb"]  # the process's own maxrss
    return {"seconds": sum(step_seconds[1:]), "steps": len(rows) - 1, "peak_mb": peak_mb}


def litgpt_step_rows(args: list, out: Path, what: str) -> list[dict]:
    """Run a litgpt command (one thread) and return its log's rows of training steps."""
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    (log,) = out.joinpath("logs").rglob("metrics.csv")
    return [row for row in csv.DictReader(open(log)) if row.get("tokens_per_sec")]


def run_script(script: str, payload: dict, what: str) -> dict:
    """Run `script` in a child interpreter (one thread) with `payload` as its JSON argument; its last line's JSON."""
    done = subprocess.run([sys.executable, "-c", script, json.dumps(payload)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_tokens(rows: list[dict], index: int) -> float:
    """A step's tokens, from the running total the log carries."""
    previous = float(rows[index - 1]["tokens"]) if index else 0.0
    return float(rows[index]["tokens"]) - previous


def run_trl(model: Path, data: Path, out: Path, method: str, batch: int, steps: int) -> dict:
    payload = dict(model=str(model), data=str(data), out=str(out), method=method, batch=batch, steps=steps,
                   tokenizer=str(TOKENIZER_DIR / "tokenizer.json"))
    return run_script(TRL_RUN, payload, "TRL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("lora", "full"), default="lora")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--answer-words", type=int, default=64)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    model = make_model(root / "model")
    data = write_pairs(root / "pairs.jsonl", options.batch * options.steps * 2, options.prompt_words,
                       options.answer_words)
    results = {"litgpt": [], "trl": []}
    for repeat in range(options.repeats):
        for name, run in (("litgpt", run_litgpt), ("trl", run_trl)):
            result = run(model, data, root / f"{name}-{repeat}", options.method, options.batch, options.steps)
            result["pairs_per_sec"] = result["steps"] * options.batch / result["seconds"]
            results[name].append(result)
            print(f"{name:6} run {repeat + 1}: {result['pairs_per_sec']:.2f} pairs/s, peak RSS "
                  f"{result['peak_mb']:,.0f} MiB", flush=True)
    summary = {name: {"pairs_per_sec": statistics.median(r["pairs_per_sec"] for r in runs),
                      "peak_mb": max(r["peak_mb"] for r in runs)} for name, runs in results.items()}
    ratio = summary["litgpt"]["pairs_per_sec"] / summary["trl"]["pairs_per_sec"]
    print(f"median: litgpt {summary['litgpt']['pairs_per_sec']:.2f} pairs/s, TRL {summary['trl']['pairs_per_sec']:.2f} "
          f"pairs/s ({ratio:.2f}x); peak RSS litgpt {summary['litgpt']['peak_mb']:,.0f} MiB, TRL "
          f"{summary['trl']['peak_mb']:,.0f} MiB")
    if options.output:
        record = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                  "load_before": os.getloadavg(), "options": {k: str(v) for k, v in vars(options).items()},
                  "runs": results, "summary": summary, "ratio": ratio}
        options.output.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
