"""Metric loggers: CSV (default), TensorBoard, Weights & Biases (offline)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from litgpt.errors import UserError

LoggerName = Literal["csv", "tensorboard", "wandb"]


def build_logger(name: str, out_dir: Path, run_name: str):
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    root = out_dir / "logs"
    if name == "csv":
        return CSVLogger(root_dir=root, name=run_name, flush_logs_every_n_steps=1)
    if name == "tensorboard":
        if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
            raise UserError("--logger_name tensorboard needs TensorBoard: pip install tensorboard")
        return TensorBoardLogger(root_dir=root, name=run_name)
    if name == "wandb":
        if importlib.util.find_spec("wandb") is None:
            raise UserError("--logger_name wandb needs Weights & Biases: pip install wandb")
        from lightning.pytorch.loggers import WandbLogger

        # Offline: runs are stored under out_dir and synced later with `wandb sync`.
        return WandbLogger(project="litgpt", name=run_name, save_dir=str(root), offline=True)
    raise UserError(f"--logger_name {name!r} is not one of csv, tensorboard, wandb.")
