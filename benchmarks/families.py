"""Training throughput and peak memory of small models shaped like the newer architecture families, ours beside
transformers.

Each shape is a `Config` of a few million parameters with every feature of its family switched on. Ours trains it for
`--steps` steps with `litgpt pretrain --model_config FILE` on the bundled story corpus; transformers trains the same
shape -- its class (GptOssForCausalLM, DeepseekV3ForCausalLM) built from the config.json that
`litgpt.convert.families.configs.config_to_hf` writes for the Config -- with a plain loop: random token ids of the same
shape (micro batch x seq, targets shifted by one), the same AdamW (torch's fused one, which ours uses on the CPU, so
the ratio compares the models), the same dtype and thread count, transformers' default attention and experts
implementations. Both are child processes of this script, measured the way benchmarks/train.py measures (its
`run_command`): tokens/s over the steps after `--warmup`, from the timestamps of the per-step log lines, and the
child's peak resident set (VmHWM) at the last step. With --repeats > 1 they alternate: ours, transformers, ours, ...

    python benchmarks/families.py                          # every shape, 1 repeat
    python benchmarks/families.py --shapes gpt-oss --steps 12 --warmup 4 --precision bf16-true --repeats 3

A new family adds an entry to SHAPES (its name and Config fields); the rest stays as it is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train import OURS_STEP, TOKENIZER_DIR, Case, Command, machine, run_command, summarize  # noqa: E402

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
    # DeepSeek-V3 (litgpt/configs/deepseek.py, shrunk): latent attention with a query bottleneck (q_lora_rank 96,
    # kv_lora_rank 64; per head 32 unrotated + 16 interleaved-rotary query/key elements, 32 value), YaRN with
    # mscale; one dense first layer, then 8 routed experts in 4 groups (2 groups chosen, 2 experts per token) by
    # sigmoid score plus the correction bias, renormalized and scaled by 2.5, and one shared expert.
    "deepseek-v3": dict(
        name="deepseek-v3-shaped-small", hf_model_type="deepseek_v3", block_size=512, vocab_size=4096,
        padded_vocab_size=4096, n_layer=4, n_embd=256, n_head=8, n_query_groups=8, head_size=48,
        norm_class_name="RMSNorm", norm_eps=1e-6, tie_embeddings=False, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_interleaved=True, rope_base=10000.0,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        mlp_class_name="LLaMAMoE", intermediate_size=512, moe_intermediate_size=128, n_expert=8,
        n_expert_per_token=2, moe_n_shared_expert=1, moe_score_function="sigmoid", moe_expert_bias=True,
        moe_group_score="top2_sum", moe_renormalize=True, moe_n_group=4, moe_topk_group=2, moe_routed_scaling=2.5,
        moe_first_dense_layers=1, router_aux_loss_coef=0.0,
    ),
}
# Runs this checkout's litgpt whatever is installed (benchmarks/train.py's children drop PYTHONPATH).
LITGPT = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
          "from litgpt.__main__ import main; main(sys.argv[1:])"]
# --precision -> (the transformers model's dtype, whether to autocast to bf16), as our Fabric precisions mean them
PRECISIONS = {"32-true": ("float32", False), "bf16-true": ("bfloat16", False), "bf16-mixed": ("float32", True)}


# ---- the transformers child ----------------------------------------------------------------------------------------
def train_transformers(hf_dir: Path, steps: int, micro_batch: int, seq: int, precision: str) -> None:
    """Train the transformers model of `hf_dir`'s config.json for `steps` steps on random token ids, printing one
    `step N/M | ...` line per step (the line benchmarks/train.py's `run_command` times). Imports torch and
    transformers only, so the process' peak memory is theirs."""
    import torch
    import transformers

    dtype, autocast = PRECISIONS[precision]
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    torch.manual_seed(42)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.train()
    print(f"{type(model).__name__}: attention {config._attn_implementation}, experts "
          f"{getattr(config, '_experts_implementation', None)}, {sum(p.numel() for p in model.parameters()):,} "
          "parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)  # what `litgpt pretrain` builds on the CPU
    generator = torch.Generator().manual_seed(42)
    for step in range(1, steps + 1):
        tokens = torch.randint(config.vocab_size, (micro_batch, seq + 1), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}/{steps} | loss {loss.item():.4f}", flush=True)


# ---- the cases -----------------------------------------------------------------------------------------------------
def build_case(shape: str, work: Path, args: argparse.Namespace) -> Case:
    """Our `litgpt pretrain` command and the transformers child's for `shape`, with their input files."""
    from litgpt.config import Config
    from litgpt.convert.families.configs import config_to_hf

    config = Config(**SHAPES[shape])
    config_file = work / f"{shape}.yaml"
    config.save(config_file)
    hf_dir = work / f"{shape}-hf"
    hf_dir.mkdir(exist_ok=True)
    hf_config = config_to_hf(config)
    (hf_dir / "config.json").write_text(json.dumps(hf_config, indent=1))
    out = work / shape
    ours = LITGPT + [
        "pretrain", "--model_config", str(config_file), "--tokenizer_dir", str(TOKENIZER_DIR),
        "--data", "Tiny", "--data.cache_dir", str(work / "data-cache"), "--out_dir", str(out),
        "--train.max_steps", str(args.steps), "--train.micro_batch_size", str(args.micro_batch),
        "--train.global_batch_size", str(args.micro_batch), "--train.max_seq_length", str(args.seq),
        "--train.log_interval", "1", "--train.save_interval", "null", "--eval.interval", "1000000",
        "--eval.initial_validation", "false", "--eval.final_validation", "false", "--devices", "1",
        "--precision", args.precision, "--logger_name", "csv",
    ]
    peer = [sys.executable, str(Path(__file__).resolve()), "--transformers-child", str(hf_dir),
            "--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
            "--precision", args.precision]
    description = f"{shape}-shaped, one process, micro batch {args.micro_batch} x seq {args.seq}"
    return Case(shape, description, args.micro_batch * args.seq,
                Command("ours", ours, out, OURS_STEP, {config_file.name: config_file.read_text()}),
                Command("transformers", peer, work / f"{shape}-transformers", OURS_STEP,
                        {"config.json": json.dumps(hf_config)}))


def measure(case: Case, args: argparse.Namespace, work: Path) -> dict:
    """--repeats runs of ours and of transformers, alternating (A B A B), each summarized by train.summarize."""
    runs: dict[str, list] = {"ours": [], "transformers": []}
    for repeat in range(args.repeats):
        for command in (case.ours, case.ref):
            log = work / f"{case.name}-{command.toolkit}-{repeat}.log"
            run = run_command(command, case, args.warmup, args.steps, args.threads, work, log, args.timeout)
            if "error" in run:
                sys.exit(f"{case.name} ({command.toolkit}): the run failed:\n{run['error']}")
            if command.toolkit == "transformers":  # the child's line naming its class and implementations
                run["model"] = next((line.split(None, 1)[1].strip() for line in log.read_text().splitlines()
                                     if "ForCausalLM:" in line), "")
            runs[command.toolkit].append(run)
            print(f"{case.name:<12} {command.toolkit:<12} #{repeat}: {run['tokens_per_sec']:,.0f} tokens/s, peak RSS "
                  f"{run['peak_rss_mb']:,.0f} MB, other load {run['other_load']:.0%}", flush=True)
    return {"shape": case.name, "description": case.description, "tokens_per_step": case.tokens_per_step,
            "config": SHAPES[case.name], "transformers_model": runs["transformers"][0]["model"],
            "commands": {c.toolkit: {"argv": c.argv, "config_files": c.files} for c in (case.ours, case.ref)},
            "runs": runs, "summary": {k: summarize(v) for k, v in runs.items()}}


def print_table(results: list[dict]) -> None:
    """Medians, ours beside transformers with the ratio: tokens/s, tokens per CPU-second of the training process
    (steadier than tokens/s when other jobs share the cores) and peak RSS."""
    columns = (("tokens/s", "median_tokens_per_sec"), ("tok/CPU-s", "median_tokens_per_cpu_second"),
               ("peak RSS MB", "median_peak_rss_mb"))
    header = f"{'shape':<12} " + " ".join(f"{name + ' ours':>16} {'transformers':>12} {'ratio':>6}"
                                          for name, _ in columns) + f" {'other load':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        ours, peer = r["summary"]["ours"], r["summary"]["transformers"]
        cells = " ".join(f"{ours[key]:>16,.0f} {peer[key]:>12,.0f} {ours[key] / peer[key]:>5.2f}x" for _, key in columns)
        print(f"{r['shape']:<12} {cells} {max(ours['max_other_load'], peer['max_other_load']):>10.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", default="32-true", choices=list(PRECISIONS))
    parser.add_argument("--threads", type=int, default=1)  # more only on a quiet machine: OpenMP threads that
    # share busy cores spin (measured: 20 tokens/s with 2 threads on 2 loaded cores, 291 with 1)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each toolkit, alternating ours and theirs")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--output", type=Path, default=None,
                        help="the JSON record (default: benchmarks/results/families-cpu-<date>.json)")
    parser.add_argument("--note", default="", help="a remark stored in the record (e.g. that the machine was shared)")
    parser.add_argument("--transformers-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_child is not None:
        train_transformers(args.transformers_child, args.steps, args.micro_batch, args.seq, args.precision)
        return
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 1 and --steps - 1")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    info = machine(None)
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        work = Path(tmp)
        results = [measure(build_case(shape, work, args), args, work) for shape in args.shapes]
    import transformers

    info.update(transformers=transformers.__version__, loadavg_at_end=Path("/proc/loadavg").read_text().split()[:3])
    print(f"\n{info['cpu']}, torch {info['torch']}, transformers {transformers.__version__}, {args.precision}, "
          f"{args.threads} thread(s), {args.steps - args.warmup} measured steps after {args.warmup}, "
          f"median of {args.repeats} run(s)")
    print_table(results)
    output = args.output or REPO / "benchmarks" / "results" / f"families-cpu-{datetime.date.today().isoformat()}.json"
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "note": args.note, "machine": info,
              "settings": {k: v for k, v in vars(args).items() if k not in ("output", "transformers_child", "note")},
              "command_line": [Path(sys.argv[0]).name, *sys.argv[1:]], "results": results}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
