"""Stopping cleanly when the scheduler says so, and agreeing across ranks on when to stop.

Slurm sends SIGTERM before it kills a job (time limit, `scancel`, preemption) and, with `#SBATCH --signal=USR1@120`,
SIGUSR1 a chosen time before that; Kubernetes and torchrun send SIGTERM. A rank that receives one finishes its step;
at the step's end every rank learns of it through one small collective, so they all save the same checkpoint and stop.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
from typing import Optional

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """While active, SIGTERM and SIGUSR1 are recorded (`received`) instead of ending the process."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, object] = {}

    def _record(self, signum, frame) -> None:
        self.received = self.received or signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class StepControl:
    """One collective per optimizer step (on a CPU gloo group: no wait on the GPU) telling every rank whether any rank
    saw a non-finite loss or gradient norm, and the stop signal any rank received."""

    def __init__(self, timeout_seconds: Optional[float]) -> None:
        import torch.distributed as dist

        self.group = None
        if dist.is_available() and dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_seconds) if timeout_seconds else None
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def agree(self, nonfinite: bool, stop_signal: int) -> tuple[bool, int]:
        import torch.distributed as dist

        flags = torch.tensor([int(nonfinite), int(stop_signal)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), int(flags[1])


def slurm_job_id() -> Optional[str]:
    """The id `scontrol requeue` takes: an array task's own id, else the job's."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> str:
    """Requeue this Slurm job (rank 0 calls this); returns what happened, in words."""
    job = slurm_job_id()
    if job is None:
        return "not requeued: this run is not a Slurm job"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"could not requeue Slurm job {job}: {error}"
    if result.returncode:
        reason = " ".join((result.stderr or result.stdout).split()) or f"exit code {result.returncode}"
        return f"could not requeue Slurm job {job}: {reason} (does the job allow it? sbatch --requeue)"
    return f"requeued Slurm job {job}; it continues with --resume auto"
