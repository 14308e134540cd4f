"""Training throughput and peak memory of small models shaped like the newer architecture families.

Each shape is a `Config` of a few million parameters with every feature of its family switched on; it trains for
`--steps` steps with `litgpt pretrain --model_config FILE` on the bundled story corpus, as a child process of this
script, measured the way benchmarks/train.py measures (its `run_command`): tokens/s over the steps after `--warmup`,
from the timestamps of the per-step log lines, and the child's peak resident set (VmHWM) at the last step.

    python benchmarks/families.py                          # every shape
    python benchmarks/families.py --shapes gpt-oss --steps 12 --warmup 4 --precision bf16-true

A new family adds an entry to SHAPES (its name and Config fields); the rest stays as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train import OURS_STEP, TOKENIZER_DIR, Case, Command, run_command  # noqa: E402

from litgpt.config import Config  # noqa: E402

# name -> Config fields. Every shape: 4096-token vocabulary (the bundled tokenizer), 4 layers, n_embd 256.
SHAPES = {
    # gpt-oss: attention sinks and biases, alternating 64-token windows, YaRN, 8 biased experts (top 2) with the
    # clamped SwiGLU and a biased router.
    "gpt-oss": dict(
        name="gpt-oss-shaped-small", hf_model_type="gpt_oss", block_size=512, vocab_size=4096,
        padded_vocab_size=4096, n_layer=4, n_embd=256, n_head=8, head_size=32, n_query_groups=2, bias=True,
        mlp_class_name="LLaMAMoE", intermediate_size=256, moe_intermediate_size=256, n_expert=8, n_expert_per_token=2,
        rope_base=150000.0, rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128,
                                              beta_fast=32.0, beta_slow=1.0, truncate=False),
        sliding_window_size=64, sliding_window_pattern=2, attention_sinks=True, router_bias=True, swiglu_alpha=1.702,
        swiglu_limit=7.0,
    ),
}
# Runs this checkout's litgpt whatever is installed (benchmarks/train.py's children drop PYTHONPATH).
LITGPT = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
          "from litgpt.__main__ import main; main(sys.argv[1:])"]


def build_case(shape: str, work: Path, args: argparse.Namespace) -> Case:
    config_file = work / f"{shape}.yaml"
    Config(**SHAPES[shape]).save(config_file)
    out = work / shape
    argv = LITGPT + [
        "pretrain", "--model_config", str(config_file), "--tokenizer_dir", str(TOKENIZER_DIR),
        "--data", "Tiny", "--data.cache_dir", str(work / "data-cache"), "--out_dir", str(out),
        "--train.max_steps", str(args.steps), "--train.micro_batch_size", str(args.micro_batch),
        "--train.global_batch_size", str(args.micro_batch), "--train.max_seq_length", str(args.seq),
        "--train.log_interval", "1", "--train.save_interval", "null", "--eval.interval", "1000000",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--devices", "1",
        "--precision", args.precision, "--logger_name", "csv",
    ]
    description = f"{shape}-shaped, one process, micro batch {args.micro_batch} x seq {args.seq}"
    return Case(shape, description, args.micro_batch * args.seq, Command("ours", argv, out, OURS_STEP), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=1)  # more only on a quiet machine: OpenMP threads that
    # share busy cores spin (measured: 20 tokens/s with 2 threads on 2 loaded cores, 291 with 1)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 1 and --steps - 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        work = Path(tmp)
        for shape in args.shapes:
            case = build_case(shape, work, args)
            run = run_command(case.ours, case, args.warmup, args.steps, args.threads, work, work / f"{shape}.log",
                              args.timeout)
            if "error" in run:
                sys.exit(f"{shape}: the run failed:\n{run['error']}")
            results.append({"shape": shape, "tokens_per_sec": run["tokens_per_sec"], "peak_rss_mb": run["peak_rss_mb"],
                            "measured_steps": run["measured_steps"], "precision": args.precision})
    print(f"{'shape':<12} {'tokens/s':>10} {'peak RSS MB':>12}")
    for r in results:
        print(f"{r['shape']:<12} {r['tokens_per_sec']:>10.1f} {r['peak_rss_mb']:>12.1f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
