"""This process's rank as the launcher set it (Fabric, torchrun, srun), readable before any process group exists."""

from __future__ import annotations

import os


def launcher_rank() -> int:
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0
