"""GRPO: the seconds of a step's generation and of its training in `litgpt grpo` beside TRL's `GRPOTrainer`, on the
same CPU, the same model (a random Llama of the 5M shape, saved by transformers and converted to litgpt, so both start
from the same weights), the same prompts, the same reward function and the same batch arithmetic.

Each step: `--prompts` prompts of `--prompt-words` one-token words, `--generations` completions of each, sampled at
temperature 1 for up to `--new-tokens` tokens (a random model almost never samples EOS, so both sides generate about
as many tokens), scored by one reward (the completion's length in characters, in TRL's signature, the same function
on both sides), one optimizer step on them (float32, beta 0, the grpo loss, AdamW). TRL generates with transformers'
`generate` (no vLLM on a CPU); litgpt with its serving engine. Each run is its own child process; the cases alternate
(A B A B). Time: steps 2..N (the first pays set-up). litgpt: its log's per-step tokens/s and generation tokens/s;
TRL: its step-end callback, and its model's `generate` timed inside the step.

    python benchmarks/grpo.py --method full --repeats 2 --steps 6 --output benchmarks/results/grpo-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo import (  # noqa: E402  (the same model and runners as dpo.py's)
    HF_MODEL, TOKENIZER_DIR, WORDS, litgpt_step_rows, make_model, run_script, step_tokens)

REWARD = "def length(prompts, completions, **fields):\n    return [len(c) / 100 for c in completions]\n"

TRL_RUN = r"""
import json, sys, time
import datasets, torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
import trl

args = json.loads(sys.argv[1])
sys.path.insert(0, args["reward_dir"])
from grpo_reward import length

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
steps, generation = [], []

class StepTimes(TrainerCallback):
    def on_step_end(self, *_, **__):
        steps.append(time.perf_counter())

config = trl.GRPOConfig(output_dir=args["out"], per_device_train_batch_size=args["prompts"] * args["generations"],
                        gradient_accumulation_steps=1, num_generations=args["generations"],
                        max_completion_length=args["new_tokens"], temperature=1.0, beta=0.0, loss_type="grpo",
                        max_steps=args["steps"], learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                        bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1000,
                        dataloader_num_workers=0, seed=0)
trainer = trl.GRPOTrainer(model=model, reward_funcs=[length], args=config, train_dataset=rows,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[StepTimes()])
generating = trainer.model.generate

def timed_generate(*a, **k):
    start = time.perf_counter()
    out = generating(*a, **k)
    generation.append(time.perf_counter() - start)
    return out

trainer.model.generate = timed_generate
trainer.train()
seconds = steps[-1] - steps[0]
print(json.dumps({"seconds": seconds, "steps": len(steps) - 1, "generation_seconds": sum(generation[1:])}))
"""


def write_prompts(path: Path, count: int, words: int) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(f" {rng.choice(WORDS)}" for _ in range(words)).strip()}) + "\n")
    return path


def run_litgpt(model: Path, data: Path, reward: Path, out: Path, options) -> dict:
    args = [sys.executable, "-m", "litgpt", "grpo", str(model), "--method", options.method, "--data", "Prompts",
            "--data.json_path", str(data), "--data.val_split_fraction", "0.05", "--out_dir", str(out),
            "--precision", "32-true", "--devices", "1", "--reward", f"{reward}:length",
            "--grpo.num_generations", str(options.generations), "--grpo.max_new_tokens", str(options.new_tokens),
            "--train.micro_batch_size", str(options.prompts), "--train.global_batch_size", str(options.prompts),
            "--train.max_steps", str(options.steps), "--train.max_seq_length", "512", "--train.log_interval", "1",
            "--train.save_interval", "1000000", "--eval.interval", "1000000", "--eval.final_validation", "false",
            "--optimizer.lr", "1e-5"]
    rows = litgpt_step_rows(args, out, "litgpt grpo")
    step_seconds = [step_tokens(rows, i) / float(row["tokens_per_sec"]) for i, row in enumerate(rows)]
    completions = options.prompts * options.generations
    generation = [float(row["completion_length"]) * completions / float(row["generation_tokens_per_sec"])
                  for row in rows]
    return {"seconds": sum(step_seconds[1:]), "steps": len(rows) - 1, "generation_seconds": sum(generation[1:])}


def run_trl(model: Path, data: Path, reward: Path, out: Path, options) -> dict:
    payload = dict(model=str(model), data=str(data), out=str(out), method=options.method, prompts=options.prompts,
                   generations=options.generations, new_tokens=options.new_tokens, steps=options.steps,
                   tokenizer=str(TOKENIZER_DIR / "tokenizer.json"), reward_dir=str(reward.parent))
    return run_script(TRL_RUN, payload, "TRL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("lora", "full"), default="full")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    model = make_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", options.prompts * (options.steps + 2) * 2, options.prompt_words)
    reward = root / "grpo_reward.py"
    reward.write_text(REWARD)
    results = {"litgpt": [], "trl": []}
    for repeat in range(options.repeats):
        for name, run in (("litgpt", run_litgpt), ("trl", run_trl)):
            result = run(model, data, reward, root / f"{name}-{repeat}", options)
            steps = result["steps"]
            result.update(step_s=result["seconds"] / steps, generation_s=result["generation_seconds"] / steps,
                          training_s=(result["seconds"] - result["generation_seconds"]) / steps)
            results[name].append(result)
            print(f"{name:6} run {repeat + 1}: {result['step_s']:.2f} s a step = generation "
                  f"{result['generation_s']:.2f} s + training and the rest {result['training_s']:.2f} s", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in ("step_s", "generation_s", "training_s")}
               for name, runs in results.items()}
    for key in ("step_s", "generation_s", "training_s"):
        print(f"median {key}: litgpt {summary['litgpt'][key]:.2f}, TRL {summary['trl'][key]:.2f} "
              f"(TRL takes {summary['trl'][key] / summary['litgpt'][key]:.2f}x as long)")
    if options.output:
        record = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                  "load_before": os.getloadavg(), "model": HF_MODEL,
                  "options": {k: str(v) for k, v in vars(options).items()}, "runs": results, "summary": summary}
        options.output.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
