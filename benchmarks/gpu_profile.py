"""Where a GPU training step's time goes, and what its parts cost alone: the measurements behind the MFU figures of
`gpu_check.sh`, for a lent GPU machine.

    python benchmarks/gpu_profile.py --out /tmp/profile                     # every part
    python benchmarks/gpu_profile.py --only step --precision bf16-mixed fp8-mixed

Parts (each prints its lines and writes <out>/<part>.json):
  step       `litgpt pretrain --profile true` of the Llama-3.2-1B shape (seq 2048, micro batch 4, compiled blocks) for
             each `--precision`; its trace's GPU kernels summed by kind (matmuls, attention, inductor's fused
             kernels, other aten kernels, optimizer, copies), the matmuls by shape with their TFLOP/s, the busiest
             kernels, and how much of the profiled steps the GPU was idle. The run is stopped once its trace is
             written (its final checkpoint would take longer than the steps).
  attention  SDPA forward + backward at the 1B shape (4 x 32 heads x 2048 x 64, 8 key-value heads, causal) with
             each backend that takes it, grouped-query heads passed as they are and expanded.
  float8     one compiled MLP forward + backward (Llama-3.2-1B: 2048 -> 8192, Llama-3.1-8B: 4096 -> 14336;
             8,192 tokens) in bf16 and in torchao float8 with rowwise and with tensorwise scales.
  head       the chunked output head + cross-entropy (8,192 positions, 2048 wide, 128,256 rows, bf16-mixed), forward
             + backward, as training runs it, with chunk sizes from 1,024 positions to all of them, eager and with
             each chunk's loss compiled (`compiled_chunk_losses`, what a GPU run that compiles its blocks does),
             beside whole logits through F.cross_entropy; milliseconds and peak memory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Kernel kinds, by name, in the order they are tried.
KINDS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|splitK", re.I)),
    ("inductor", re.compile(r"^triton", re.I)),
]
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul")


def kind_of(name: str, category: str) -> str:
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other aten")


def matmul_flops(op: str, dims) -> float:
    """2 M N K of an mm/addmm/_scaled_mm/bmm/baddbmm from its recorded input dimensions (0 when they do not say)."""
    try:
        a, b = dims[1:3] if op in ("aten::addmm", "aten::baddbmm") else dims[:2]  # (bias, a, b) or (a, b, ...)
        batch = a[0] if len(a) == 3 else 1
        return 2.0 * batch * a[-2] * a[-1] * b[-1]
    except (IndexError, TypeError, ValueError):
        return 0.0


def summarize_trace(path: Path, steps: int, top: int = 25) -> dict:
    """The trace's kernels per profiled step: time by kind, the matmuls by shape, the busiest kernels, idle time."""
    events = json.loads(path.read_text())["traceEvents"]
    ops = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            ops.setdefault(e["args"]["External id"], e)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return {"error": "no GPU kernels in the trace"}
    by_kind, by_name, by_shape = collections.Counter(), collections.Counter(), {}
    counts = collections.Counter()
    for k in kernels:
        kind = kind_of(k["name"], k["cat"])
        by_kind[kind] += k["dur"]
        by_name[(kind, k["name"][:120])] += k["dur"]
        counts[(kind, k["name"][:120])] += 1
        op = ops.get(k.get("args", {}).get("External id"))
        if kind == "matmul" and op is not None and op["name"] in MATMUL_OPS:
            dims = op["args"].get("Input Dims", [])
            key = f"{op['name']} {dims[:3]} {op['args'].get('Input type', [])[:3]}"
            entry = by_shape.setdefault(key, {"us": 0.0, "flops": matmul_flops(op["name"], dims), "calls": 0})
            entry["us"] += k["dur"]
            entry["calls"] += 1
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    busy = sum(by_kind.values())
    per_step = lambda us: round(us / steps / 1000, 2)  # noqa: E731 - microseconds in all steps -> ms per step
    shapes = sorted(by_shape.items(), key=lambda kv: -kv[1]["us"])[:top]
    return {
        "profiled_steps": steps,
        "gpu_span_ms_per_step": per_step(end - start),
        "kernel_ms_per_step": per_step(busy),
        "idle_fraction": round(1 - busy / max(1.0, end - start), 3),
        "ms_per_step_by_kind": {kind: per_step(us) for kind, us in by_kind.most_common()},
        "matmuls_by_shape": [{"op": key, "ms_per_step": per_step(v["us"]), "calls_per_step": v["calls"] / steps,
                              "tflops": round(v["flops"] * v["calls"] / (v["us"] * 1e-6) / 1e12, 1) if v["us"] else 0}
                             for key, v in shapes],
        "busiest_kernels": [{"kind": kind, "kernel": name, "ms_per_step": per_step(us),
                             "calls_per_step": counts[(kind, name)] / steps}
                            for (kind, name), us in by_name.most_common(top)],
    }


def profile_step(precision: str, work: Path, compiler: str) -> dict:
    """A profiled `litgpt pretrain` of the 1B shape, stopped as soon as its trace is written."""
    from litgpt.data.tiny import TINY_DIR

    out = work / f"step-{precision}"
    argv = [sys.executable, "-m", "litgpt", "pretrain", "Llama-3.2-1B", "--tokenizer_dir", str(TINY_DIR / "tokenizer"),
            "--data", "Tiny", "--data.cache_dir", str(work / "tiny-cache"), "--out_dir", str(out),
            "--train.max_seq_length", "2048", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
            "--train.max_steps", "6", "--train.log_interval", "1", "--train.lr_warmup_steps", "2",
            "--train.save_interval", "null", "--eval.interval", "100000", "--eval.initial_validation", "false",
            "--eval.final_validation", "false", "--precision", precision, "--compiler", compiler, "--profile", "true"]
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in process.stdout:
        log.append(line.rstrip())
        print("   ", line.rstrip(), flush=True)
        if "Wrote a profiler trace" in line or "ended before the profiler" in line:
            process.kill()
            break
    process.wait()
    trace = out / "profile" / "trace-rank0.json"
    if not trace.is_file():
        return {"precision": precision, "error": "no trace", "log": log[-30:]}
    rates = [float(m.group(1).replace(",", "")) for m in (re.search(r"\| ([\d,]+) tokens/s", l) for l in log) if m]
    summary = summarize_trace(trace, steps=3)  # the profiler's schedule: skip 2 steps, record 3
    return {"precision": precision, "compiler": compiler, "tokens_per_s_by_step": rates,
            "seconds": round(time.perf_counter() - started, 1), **summary}


def cuda_milliseconds(fn, steps: int = 10, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / steps, 3)


def attention_part() -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, G, T, D = 4, 32, 8, 2048, 64
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 4 * B * H * T * T * D / 2 * 3.5  # causal: half the scores; backward 2.5x the forward
    results = {}
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", None):
        for gqa in ("enable_gqa", "expanded"):
            name = f"{backend or 'default'} {gqa}"

            def step():
                expand = gqa != "enable_gqa"
                kk, vv = (t.repeat_interleave(H // G, 1) if expand else t for t in (k, v))
                y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa == "enable_gqa")
                y.backward(torch.ones_like(y))
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
                    ms = cuda_milliseconds(step)
                results[name] = {"ms": ms, "tflops": round(flops / ms / 1e9, 1)}
            except RuntimeError as e:
                results[name] = {"error": str(e).splitlines()[0][:160]}
            print(f"   attention {name}: {results[name]}", flush=True)
    return results


def float8_part() -> dict:
    import copy

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from litgpt.config import Config
    from litgpt.mlp import LLaMAMLP

    results = {}
    for model_name in ("Llama-3.2-1B", "Llama-3.1-8B"):
        config = Config.from_name(model_name)
        with torch.device("cuda"):
            mlp = LLaMAMLP(config)
        x = torch.randn(4, 2048, config.n_embd, device="cuda", requires_grad=True)
        for recipe in ("bf16", "rowwise", "tensorwise"):
            module = copy.deepcopy(mlp)
            if recipe != "bf16":
                convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
            compiled = torch.compile(module)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    compiled(x).sum().backward()
            try:
                results[f"{model_name} {recipe}"] = cuda_milliseconds(step)
            except Exception as e:  # noqa: BLE001 - a recipe this torch/torchao cannot run is reported, not fatal
                results[f"{model_name} {recipe}"] = f"error: {str(e).splitlines()[0][:160]}"
            print(f"   float8 {model_name} {recipe}: {results[f'{model_name} {recipe}']} ms", flush=True)
        for recipe in ("rowwise", "tensorwise"):
            bf16, fp8 = results[f"{model_name} bf16"], results[f"{model_name} {recipe}"]
            if isinstance(fp8, float):
                results[f"{model_name} {recipe} speedup"] = round(bf16 / fp8, 3)
    return results


def head_part() -> dict:
    import torch
    import torch.nn.functional as F

    from litgpt.train.loss import OutputHead, chunked_head_loss, compiled_chunk_losses, cross_entropy_chunk

    positions, width, vocab = 8192, 2048, 128256
    weight = torch.nn.Parameter(torch.randn(vocab, width, device="cuda") * 0.02)
    hidden = torch.randn(positions, width, device="cuda", requires_grad=True)
    labels = torch.randint(0, vocab, (positions,), device="cuda")
    results = {}

    def run(chunk, compiled):
        chunks = compiled_chunk_losses() if compiled else contextlib.nullcontext()
        with torch.autocast("cuda", dtype=torch.bfloat16), chunks:
            if chunk == "whole":
                loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
            else:
                loss = chunked_head_loss(hidden, OutputHead(weight), labels, cross_entropy_chunk, chunk) / positions
        loss.backward()
        weight.grad = hidden.grad = None

    # Eager chunks (a run that compiles nothing), compiled ones (`compiled_chunk_losses`: a GPU run that compiles its
    # blocks), and whole logits through F.cross_entropy.
    for name, chunk, compiled in [(f"{c}{' compiled' if k else ''}", c, k) for k in (False, True)
                                  for c in (1024, 2048, 8192)] + [("whole", "whole", False)]:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = cuda_milliseconds(lambda: run(chunk, compiled), steps=5, warmup=2)
        results[name] = {"ms": ms, "peak_mib_over_inputs": (torch.cuda.max_memory_allocated() - base) >> 20}
        print(f"   head {name}: {results[name]}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/litgpt-gpu-profile"))
    parser.add_argument("--only", nargs="*", default=["step", "attention", "float8", "head"])
    parser.add_argument("--precision", nargs="*", default=["bf16-mixed", "fp8-mixed"])
    parser.add_argument("--compiler", default="torch")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # litgpt from this checkout, as the subprocesses import it
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    parts = {"step": lambda: [profile_step(p, args.work, args.compiler) for p in args.precision],
             "attention": attention_part, "float8": float8_part, "head": head_part}
    for name in args.only:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            result = parts[name]()
        except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others' figures
            result = {"error": f"{type(e).__name__}: {e}"}
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1)[:6000], flush=True)
        print(f"== {name} took {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
