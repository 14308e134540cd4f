"""`--profile`: a torch.profiler trace of a few training steps, written to out_dir/profile/."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def start_profiler():
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                       record_shapes=True, with_stack=False)
    profiler.start()
    return profiler


def stop_profiler(profiler, out_dir: Path, rank: int) -> None:
    profiler.stop()
    if rank == 0:
        path = Path(out_dir) / "profile" / f"trace-rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            profiler.export_chrome_trace(str(path))
        except RuntimeError:
            print("The run ended before the profiler recorded its steps (it skips 2, records 3).", file=sys.stderr)
            return
        print(f"Wrote a profiler trace (chrome://tracing, Perfetto or TensorBoard) to {path}", file=sys.stderr)
