"""benchmarks/gpu_check.py's parts that run without a GPU: the summary it prints, read from a real H200 run's files
(benchmarks/results/gpu-check-2026-11-28, written there by the script of that day), and its stage runner's time
limit, which must stop a stage together with the processes the stage started."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Loaded from its file: benchmarks/ on sys.path would let its thunder.py stand for the thunder package in every later
# test of this worker.
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check  # its dataclass looks its module up there
_spec.loader.exec_module(gpu_check)

H200_RUN = REPO / "benchmarks" / "results" / "gpu-check-2026-11-28"


def test_the_summary_reads_each_stage_of_a_real_h200_run():
    lines = gpu_check.summary(H200_RUN)
    assert lines[0] == 'fp8_mlp: {"bf16_ms": 3.854, "fp8_graph_breaks": [], "fp8_ms": 4.05, "fp8_speedup": 0.952}'
    assert "training pretrain-1b-compiled: 56,262 tokens/s, MFU 46.8% of the datasheet bf16 peak" in lines[1]
    assert lines[1].endswith("peak memory 33.6 GiB")
    # 55,526 / 56,262 tokens/s; that day's run had no tensorwise case, and the summary claims none.
    assert "training fp8-mixed (rowwise) / bf16-mixed: 0.99x" in lines
    assert not any("tensorwise" in line for line in lines)
    assert "moe litgpt grouped (grouped): 1,648,967 tokens/s (6.92x the loop)" in lines
    assert "generation generate-5m-bf16-true-compiled: 2,222 tokens/s (warm samples)" in lines
    assert "qlora: no results" in lines  # that call's QLoRA stage ran out of its budget
    plans = [line for line in lines if line.startswith("plan:")]
    assert len(plans) == 2 and "ratio 0.997" in plans[0] and "ratio 0.930" in plans[1]


def test_a_stage_past_its_limit_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    stage = gpu_check.Stage("sleeper", ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], limit=2)
    start = time.perf_counter()
    result = gpu_check.run_stage(stage, tmp_path, tmp_path, seconds_left=100)
    assert result["returncode"] == "timeout" and time.perf_counter() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not alive(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the stage's own child outlived its time limit")


def alive(pid: int) -> bool:
    """Whether process `pid` runs: neither gone nor a zombie (killed, not yet reaped by whoever inherited it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
