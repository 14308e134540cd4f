"""Tokens/s of one mixture-of-experts layer, forward + backward: the per-expert loop litgpt had, litgpt's grouped
layer, and transformers' own Qwen3-MoE block (its default eager experts and its `grouped_mm` experts), all with the
same weights and input.

    OMP_NUM_THREADS=1 python benchmarks/moe.py                       # n_embd 1024, 64 experts, k 8, 4096 tokens
    python benchmarks/moe.py --device cuda --dtype bfloat16 --tokens 16384

The shape is a Qwen3-30B-A3B layer scaled down to fit a CPU (Qwen3-30B-A3B: n_embd 2048, 128 experts, k 8,
moe_intermediate_size 768). The implementations take `--warmup` untimed steps, then `--steps` timed ones, in turn;
the median step gives tokens/s, timed by the process' CPU time on the CPU (with OMP_NUM_THREADS=1 the work done,
whatever a shared host's neighbours do; wall time beside it) and by wall time on CUDA. Every output is checked
against the loop's. The JSON result goes to
benchmarks/results/moe-<device>-<date>.json unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from litgpt.config import Config
from litgpt.moe import LLaMAMoE


def loop_moe(moe: LLaMAMoE, x: torch.Tensor) -> torch.Tensor:
    """The algorithm litgpt's LLaMAMoE ran before: torch.where per expert (a host sync each), index_add_."""
    B, T, C = x.shape
    x = x.reshape(-1, C)
    router = torch.softmax(moe.gate(x), dim=-1, dtype=torch.float32)
    weights, chosen = router.topk(moe.config.n_expert_per_token, dim=-1)
    if moe.config.moe_renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert_idx, expert in enumerate(moe.experts):
        token_idx, slot = torch.where(chosen == expert_idx)
        if token_idx.numel() == 0:
            continue
        out.index_add_(0, token_idx, expert(x[token_idx]) * weights[token_idx, slot, None])
    return out.view(B, T, C)


def transformers_block(moe: LLaMAMoE, experts_implementation: str):
    """transformers' Qwen3MoeSparseMoeBlock with `moe`'s weights (experts fused as [gate; up] and down tensors)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    c = moe.config
    hf_config = Qwen3MoeConfig(hidden_size=c.n_embd, moe_intermediate_size=c.moe_intermediate_size,
                               num_experts=c.n_expert, num_experts_per_tok=c.n_expert_per_token,
                               norm_topk_prob=c.moe_renormalize, hidden_act="silu")
    hf_config._experts_implementation = experts_implementation
    weight = moe.gate.weight
    block = Qwen3MoeSparseMoeBlock(hf_config).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([expert.fc_1.weight, expert.fc_2.weight]))
            block.experts.down_proj[e].copy_(expert.proj.weight)
    return block


def one_step(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Wall and process CPU seconds of one forward + backward step, and its output."""
    synchronize = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    x.grad = None
    synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(x)
    out.backward(grad)
    synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu, out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--n_expert", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--moe_intermediate_size", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="implementations whose names start so (loop, litgpt, transformers)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = Config(n_layer=1, n_embd=args.n_embd, n_head=8, mlp_class_name="LLaMAMoE", n_expert=args.n_expert,
                    n_expert_per_token=args.k, moe_intermediate_size=args.moe_intermediate_size)
    moe = LLaMAMoE(config).to(device=args.device, dtype=dtype)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.normal_(0, 0.02 if name == "gate.weight" else 0.05)
    x = torch.randn(1, args.tokens, args.n_embd, device=args.device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    kernel = moe._kernel(x.reshape(-1, args.n_embd), dtype)
    candidates = {
        "loop (litgpt before)": lambda x: loop_moe(moe, x),
        f"litgpt grouped ({kernel})": moe,
        "transformers eager": transformers_block(moe, "eager"),
        "transformers grouped_mm": transformers_block(moe, "grouped_mm"),
    }
    candidates = {name: fn for name, fn in candidates.items()
                  if not args.only or any(name.startswith(prefix) for prefix in args.only)}
    rows, outputs = {name: dict(name=name, wall_s=[], cpu_s=[]) for name in candidates}, {}
    # Steps taken in turn (one of each implementation per round), so a busy neighbour slows them alike.
    for step in range(args.warmup + args.steps):
        for name, fn in candidates.items():
            if "error" in rows[name]:
                continue
            try:
                wall, cpu, out = one_step(fn, x, grad)
            except (RuntimeError, NotImplementedError, ValueError) as error:
                rows[name]["error"] = str(error).splitlines()[0]
                continue
            outputs.setdefault(name, out)
            if step >= args.warmup:
                rows[name]["wall_s"].append(wall)
                rows[name]["cpu_s"].append(cpu)
    # On the CPU the process' CPU time (one thread: the work done, whatever the neighbours do); on CUDA wall time.
    clock = "cpu_s" if args.device == "cpu" else "wall_s"
    reference = next(iter(outputs.values()))
    for name, row in rows.items():
        if "error" in row:
            print(f"{name}: {row['error']}")
            continue
        row["tokens_per_s"] = args.tokens / statistics.median(row[clock])
        row["max_rel_diff"] = ((outputs[name] - reference).abs().max() / reference.abs().max()).item()
        print(f"{name:32s} {row['tokens_per_s']:10,.0f} tokens/s  (median {clock} {statistics.median(row[clock]):.3f}, "
              f"wall {statistics.median(row['wall_s']):.3f} s, diff {row['max_rel_diff']:.1e})")
    rows = list(rows.values())

    base = next((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), None)
    print(f"\n| implementation | tokens/s ({clock}) | vs loop |\n| --- | ---: | ---: |")
    for r in rows:
        if "tokens_per_s" in r:
            print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x |")
    result = dict(
        date=datetime.date.today().isoformat(), torch=torch.__version__, device=args.device, dtype=args.dtype,
        threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        shape=dict(n_embd=args.n_embd, n_expert=args.n_expert, k=args.k,
                   moe_intermediate_size=args.moe_intermediate_size, tokens=args.tokens),
        warmup=args.warmup, steps=args.steps, clock=clock, results=rows,
    )
    output = args.output or Path(__file__).parent / "results" / f"moe-{args.device}-{result['date']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {output}")


if __name__ == "__main__":
    main()
