"""Where the time of the CPU suite's 5M cases goes, and the most tokens/s any toolkit could reach on this machine.

    python benchmarks/roofline.py
    python benchmarks/roofline.py --compare benchmarks/results/run-cpu-2026-11-23*.json --output roofline.json

Both measurements run our model in this process, on the 5M Llama shape of `run.py`:

* Training (`--precision 32-true` or `bf16-mixed`, autocast to bf16 as Fabric does): one pretrain step (micro batch
  4 = global batch, seq 256): forward, the chunked cross-entropy of `litgpt.train.loss` (the head applied by the
  loss, as training does), backward, gradient-norm clipping and fused AdamW, eager. torch.profiler splits the step's
  CPU time into the matrix multiplications (aten::mm/addmm/bmm), the attention kernels, and everything else. The matmuls' FLOP rate is set
  beside the 2048^3 matmul peak measured here. **Bound**: tokens per step / (matmul + attention time), the tokens/s of
  a step whose every other op (norms, activations, loss, optimizer) took no time at all.
* Decoding: 200 tokens, KV cache, top-k 50, eager. Each token multiplies a (1, n) row by every weight matrix, so
  the matmuls stream the weights once per token; their achieved bandwidth is set beside a large-copy bandwidth
  measured here. **Bound**: 1 / matmul time per token.

The headroom is bound / the tokens/s measured here at the same time (a shared host's speed drifts, so bounds are
compared with figures of the same moment). With `--compare` (`run.py` results JSONs; a later file's case replaces an
earlier one's) the side-by-side ratio ours / LitGPT of pretrain-5m-PRECISION and generate-5m-32-true is multiplied by
that headroom: the largest ratio over LitGPT that removing all work but the matmuls (and attention, in training)
from ours could give on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import MODEL  # noqa: E402  (the 5M Llama shape of the suite)

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_PREFIX = "aten::_scaled_dot_product"  # the fused kernels, forward and backward
TRAIN_BATCH, TRAIN_SEQ, DECODE_TOKENS = 4, 256, 200


def matmul_peak(seconds: float = 3.0, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    best, budget = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < budget:
        start = time.perf_counter()
        for _ in range(3):
            a @ b
        best = max(best, 3 * 2 * 2048**3 / (time.perf_counter() - start))
    return best


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of copying a tensor much larger than the caches (read + write counted)."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = max(best, 2 * source.numel() * 4 / (time.perf_counter() - start))
    return best


def split_time(run, repeats: int) -> dict:
    """Profile `run` `repeats` times: seconds per call spent in matmuls, attention kernels and all ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run()
    split = {"matmul": 0.0, "attention": 0.0, "all_ops": 0.0}
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / repeats
        if not event.key.startswith("aten::"):
            continue  # profiler ranges (optimizer step, ...) wrap aten ops whose time is counted already
        split["all_ops"] += seconds
        if event.key in MATMUL_OPS:
            split["matmul"] += seconds
        elif event.key.startswith(ATTENTION_PREFIX):
            split["attention"] += seconds
    return split


def wall_time(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_model():
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    return GPT(Config(**MODEL))


def linear_weight_bytes(model) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def training(steps: int, precision: str) -> dict:
    from litgpt.train.loss import loss_function
    from litgpt.train.metrics import flops_per_token

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    batch = torch.randint(0, MODEL["padded_vocab_size"], (TRAIN_BATCH, TRAIN_SEQ + 1))
    loss_of = loss_function("cross_entropy")

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = loss_of(model, batch[:, :-1], batch[:, 1:])["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    tokens = TRAIN_BATCH * TRAIN_SEQ
    seconds = wall_time(step, steps)
    split = split_time(step, steps)
    # Matmul FLOPs of a step: 6 x (every weight matrix but the embedding lookup) per token.
    matmul_flops = 6 * linear_weight_bytes(model) / 4 * tokens
    return {
        "step_seconds": seconds, "tokens_per_s": tokens / seconds, **{f"{k}_seconds": v for k, v in split.items()},
        "matmul_flops_per_s": matmul_flops / split["matmul"],
        "model_flops_per_token": flops_per_token(model.config, TRAIN_SEQ),
        "bound_tokens_per_s": tokens / (split["matmul"] + split["attention"]),
    }


def decoding(repeats: int) -> dict:
    from litgpt.generate import generate

    model = build_model().eval().requires_grad_(False)
    prompt = list(range(1, 6))

    def run() -> None:
        for _ in generate(model, prompt, DECODE_TOKENS, temperature=0.8, top_k=50):
            pass

    with torch.inference_mode():
        run()
        seconds = wall_time(run, repeats)
        split = split_time(run, repeats)
    per_token = {k: v / DECODE_TOKENS for k, v in split.items()}
    weight_bytes = linear_weight_bytes(model)
    return {
        "token_seconds": seconds / DECODE_TOKENS, "tokens_per_s": DECODE_TOKENS / seconds,
        **{f"{k}_seconds_per_token": v for k, v in per_token.items()},
        "linear_weight_bytes": weight_bytes, "matmul_bytes_per_s": weight_bytes / per_token["matmul"],
        "bound_tokens_per_s": 1 / per_token["matmul"],
    }


def side_by_side(paths: list[Path], precision: str) -> dict:
    """Ours / LitGPT (medians) of the cases the bounds are for, with the file each came from."""
    ratios = {}
    for path in paths:
        for result in json.loads(path.read_text())["results"]:
            key = {f"pretrain-5m-{precision}": "training", "generate-5m-32-true": "decoding"}.get(result["case"])
            ours, reference = result["summary"].get("ours"), result["summary"].get("litgpt")
            if key and ours and reference:
                ratios[key] = {"ratio": ours["median"] / reference["median"], "file": path.name}
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps timed and profiled")
    parser.add_argument("--repeats", type=int, default=3, help="200-token generations timed and profiled")
    parser.add_argument("--compare", type=Path, nargs="+", default=[], help="run.py results JSONs with LitGPT's figures")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true",
                        help="training's precision (decoding runs in 32-true)")
    args = parser.parse_args()

    machine = {"torch": torch.__version__, "threads": torch.get_num_threads(), "precision": args.precision,
               "matmul_peak_flops_fp32": matmul_peak(), "copy_bytes_per_s": copy_bandwidth()}
    if args.precision == "bf16-mixed":
        machine["matmul_peak_flops_bf16"] = matmul_peak(dtype=torch.bfloat16)
    train, decode = training(args.steps, args.precision), decoding(args.repeats)
    peak = machine["matmul_peak_flops_bf16" if args.precision == "bf16-mixed" else "matmul_peak_flops_fp32"]
    print(f"machine: {machine['threads']} threads, {args.precision} matmul peak {peak / 1e9:.1f} GFLOP/s, "
          f"copy {machine['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    step = train["step_seconds"]
    print(f"training step {step * 1e3:.0f} ms ({train['tokens_per_s']:,.0f} tokens/s): matmuls "
          f"{train['matmul_seconds'] * 1e3:.0f} ms at {train['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
          f"({train['matmul_flops_per_s'] / peak:.0%} of peak), attention {train['attention_seconds'] * 1e3:.0f} ms, "
          f"other ops {(train['all_ops_seconds'] - train['matmul_seconds'] - train['attention_seconds']) * 1e3:.0f} ms"
          f" (profiled); bound {train['bound_tokens_per_s']:,.0f} tokens/s")
    print(f"decoding {decode['token_seconds'] * 1e3:.2f} ms/token ({decode['tokens_per_s']:,.0f} tokens/s): matmuls "
          f"{decode['matmul_seconds_per_token'] * 1e3:.2f} ms streaming {decode['linear_weight_bytes'] / 2**20:.1f} MiB "
          f"of weights at {decode['matmul_bytes_per_s'] / 1e9:.1f} GB/s; bound {decode['bound_tokens_per_s']:,.0f} "
          "tokens/s")
    result = {"machine": machine, "training": train, "decoding": decode}
    for key in ("training", "decoding"):
        result[key]["headroom"] = result[key]["bound_tokens_per_s"] / result[key]["tokens_per_s"]
        print(f"{key}: headroom {result[key]['headroom']:.2f}x")
    ratios = side_by_side(args.compare, args.precision)
    for key, measured in ratios.items():
        measured["largest_possible_ratio"] = measured["ratio"] * result[key]["headroom"]
        kept = "the matmuls and attention" if key == "training" else "the matmuls"
        print(f"{key}: ours / LitGPT {measured['ratio']:.2f}x side by side ({measured['file']}); with no time outside "
              f"{kept} at most {measured['largest_possible_ratio']:.2f}x")
    result["versus_litgpt"] = ratios
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
