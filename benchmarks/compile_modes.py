"""What torch.compile buys a training step of the 5M Llama on the CPU: eager, each block compiled (`--compiler torch`
with several processes or on GPUs), the whole model compiled (LitGPT 0.5.13's way, the loss outside), the whole loss
compiled (model, chunked head and cross-entropy in one graph: `--compiler torch`/`auto` in one CPU process), and the
optimizer step compiled on top of compiled blocks; with --litgpt-venv, LitGPT 0.5.13's step beside them ("litgpt":
its pretrain's `torch.compile(model)`, `chunked_cross_entropy` on the whole logits, foreach AdamW, in that venv).

    python benchmarks/compile_modes.py --precision bf16-mixed --repeats 2 --steps 15
    python benchmarks/compile_modes.py --modes eager,loss,litgpt --litgpt-venv /tmp/litgpt-ref --output results.json

Each run is a fresh process (micro batch 4 x 256, fused AdamW, clipping, as `litgpt pretrain` steps), the modes taken
in turn (A B C A B C ...). Per run: the first step's wall time (with compilation; inductor's cache in
--cache-dir is shared by the runs, so only a mode's first run compiles cold) and the median over steps 4 to the last
of wall time and of the process's CPU time. On a shared machine CPU time (1 thread) is the steadier measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("eager", "blocks", "whole", "loss", "blocks+optimizer")

LITGPT_CHILD = r"""
import json, statistics, sys, time, torch
from litgpt.model import GPT, Config
from litgpt.utils import chunked_cross_entropy
precision, steps, model_args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
torch.manual_seed(0)
model = torch.compile(GPT(Config(**model_args)))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=False)
batch = torch.randint(0, model_args["padded_vocab_size"], (4, 257))
walls, cpus = [], []
for _ in range(steps):
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = chunked_cross_entropy(model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
print(json.dumps({"first_step_s": walls[0], "wall_ms": statistics.median(walls[3:]) * 1e3,
                  "cpu_ms": statistics.median(cpus[3:]) * 1e3, "loss": loss.item(), "graphs": 0, "graph_breaks": 0}))
"""

CHILD = r"""
import json, statistics, sys, time, torch
from torch._dynamo.utils import counters
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.train.loss import loss_function
sys.path.insert(0, sys.argv[4])
from train import MODEL
mode, precision, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = GPT(Config(**MODEL))
if mode.startswith("blocks"):
    for block in model.transformer.h:
        block.compile()
if mode == "whole":
    model.compile()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
loss_of = loss_function("cross_entropy")
if mode == "loss":
    for local in {False, model.config.rope_local_base is not None}:
        model.rope_tables(torch.device("cpu"), local)
    loss_of = torch.compile(loss_of)
optimizer_step = torch.compile(optimizer.step) if mode.endswith("+optimizer") else optimizer.step
batch = torch.randint(0, MODEL["padded_vocab_size"], (4, 257))
walls, cpus = [], []
for _ in range(steps):
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = loss_of(model, batch[:, :-1], batch[:, 1:])["loss"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer_step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
print(json.dumps({"first_step_s": walls[0], "wall_ms": statistics.median(walls[3:]) * 1e3,
                  "cpu_ms": statistics.median(cpus[3:]) * 1e3, "loss": loss.item(),
                  "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--steps", type=int, default=15, help="steps per run, the first one (compilation) apart")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/litgpt-compile-modes"))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--litgpt-venv", type=Path, default=None, help="virtual environment with litgpt==0.5.13")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "litgpt" in modes and args.litgpt_venv is None:
        raise SystemExit("mode litgpt needs --litgpt-venv")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from train import REF_MODEL
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads),
           "TORCHINDUCTOR_CACHE_DIR": str(args.cache_dir)}
    runs = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            if mode == "litgpt":  # cwd outside the repository: its python must import its own litgpt
                argv = [str(args.litgpt_venv / "bin" / "python"), "-c", LITGPT_CHILD, args.precision, str(args.steps),
                        json.dumps(REF_MODEL)]
                child_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
            else:
                argv = [sys.executable, "-c", CHILD, mode, args.precision, str(args.steps), str(REPO / "benchmarks")]
                child_env = env
            out = subprocess.run(argv, capture_output=True, text=True, env=child_env, timeout=3600, cwd="/")
            if out.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(run)
            print(f"{mode:<18} run {repeat + 1}: first step {run['first_step_s']:6.1f} s, then {run['wall_ms']:6.1f} "
                  f"ms wall, {run['cpu_ms']:6.1f} ms CPU a step, loss {run['loss']:.4f}, {run['graphs']} graph(s), "
                  f"{run['graph_breaks']} break(s)", flush=True)
    eager_cpu = statistics.median(r["cpu_ms"] for r in runs["eager"]) if "eager" in runs else None
    print(f"\n{'mode':<18} {'CPU ms/step':>12} {'vs eager':>9} {'wall ms/step':>13} {'first step s (cold, warm)':>26}")
    for mode, mode_runs in runs.items():
        cpu = statistics.median(r["cpu_ms"] for r in mode_runs)
        firsts = ", ".join(f"{r['first_step_s']:.1f}" for r in mode_runs)
        print(f"{mode:<18} {cpu:>12.1f} {(eager_cpu / cpu if eager_cpu else 0):>8.2f}x "
              f"{statistics.median(r['wall_ms'] for r in mode_runs):>13.1f} {firsts:>26}")
    if args.output is not None:
        args.output.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command_line": ["python", *sys.argv],
            "precision": args.precision, "threads": args.threads, "loadavg_at_end": os.getloadavg(), "runs": runs,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
