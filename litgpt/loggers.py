"""Experiment trackers: CSV (default), TensorBoard, Weights & Biases and MLflow, through Lightning's loggers (which
call the trackers' own clients). Fabric hands every logged metric to each logger, whose methods act on global rank 0
only; `start_tracking` and `log_final_metrics` are for rank 0 alone."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

from litgpt.args import LoggerArgs
from litgpt.errors import UserError

LoggerName = Literal["csv", "tensorboard", "wandb", "mlflow"]
DEFAULT_PROJECT = "litgpt"
WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def build_logger(name: str, out_dir: Path, run_name: str, settings: LoggerArgs = LoggerArgs()):
    """The `name` tracker's logger for a run in `out_dir`, named `settings.name` or else `run_name`."""
    settings.check(name)
    run_name = settings.name or run_name
    root = out_dir / "logs"
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger  # Lightning's, not Fabric's: it records the hyperparameters

        return CSVLogger(save_dir=root, name=run_name, flush_logs_every_n_steps=1)
    if name == "tensorboard":
        if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
            raise UserError("--logger_name tensorboard needs TensorBoard: pip install tensorboard")
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=root, name=run_name, default_hp_metric=False)
    if name == "wandb":
        return wandb_logger(root, run_name, settings)
    return mlflow_logger(out_dir, run_name, settings)


def wandb_logger(root: Path, run_name: str, settings: LoggerArgs):
    """W&B online, unless WANDB_MODE says offline (stored under out_dir/logs/wandb, `wandb sync` uploads it later) or
    disabled; wandb itself reads WANDB_MODE, WANDB_API_KEY and the rest of its environment."""
    if importlib.util.find_spec("wandb") is None:
        raise UserError("--logger_name wandb needs Weights & Biases: pip install wandb")
    from lightning.pytorch.loggers import WandbLogger

    root.mkdir(parents=True, exist_ok=True)  # wandb writes its files under save_dir only if it exists
    return WandbLogger(name=run_name, project=settings.project or DEFAULT_PROJECT, save_dir=str(root),
                       entity=settings.entity, group=settings.group, tags=settings.tags)


def mlflow_logger(out_dir: Path, run_name: str, settings: LoggerArgs):
    """MLflow to MLFLOW_TRACKING_URI, else to a local store in out_dir/mlruns: an SQLite database (mlflow.db) and an
    artifacts folder. Not MLflow's plain-folder store: MLflow 3 refuses it unless MLFLOW_ALLOW_FILE_STORE is set."""
    if importlib.util.find_spec("mlflow") is None:
        raise UserError("--logger_name mlflow needs MLflow: pip install mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    tracking_uri, artifact_location = os.environ.get("MLFLOW_TRACKING_URI"), None
    if not tracking_uri:
        store = Path(out_dir).resolve() / "mlruns"
        store.mkdir(parents=True, exist_ok=True)  # SQLite creates the database, not its folder
        tracking_uri, artifact_location = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
    return MLFlowLogger(experiment_name=settings.project or DEFAULT_PROJECT, run_name=run_name,
                        tracking_uri=tracking_uri, artifact_location=artifact_location,
                        tags={tag: "" for tag in settings.tags or ()})


def start_tracking(loggers, hyperparameters: dict) -> None:
    """Start each tracker's run and record the command's arguments in it, once; a tracker that cannot start the run
    (no W&B login, an MLflow server that does not answer) stops the run here, in one line."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    for logger in loggers:
        try:
            logger.log_hyperparams(hyperparameters)
        except Exception as error:  # each client raises its own types (and wandb's vary by version): any means no run
            if not isinstance(logger, (WandbLogger, MLFlowLogger)):
                raise
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if isinstance(logger, WandbLogger):
                raise UserError(f"W&B could not start the run ({first_line}): run `wandb login` or set WANDB_API_KEY, "
                                "or set WANDB_MODE=offline to keep it under out_dir/logs for `wandb sync`.") from error
            raise UserError(f"MLflow could not start the run ({first_line}): check MLFLOW_TRACKING_URI, or unset it "
                            "to keep the run in out_dir/mlruns.") from error


def log_final_metrics(loggers, metrics: dict, step: int) -> None:
    """metrics.json in the trackers: its numbers as run/* metrics in each, and the whole file (its text values too)
    as the W&B run's summary and as an MLflow artifact, metrics.json."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    numbers = {f"run/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
    for logger in loggers:
        logger.log_metrics(numbers, step=step)
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update({f"run/{k}": v for k, v in metrics.items()})
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_dict(logger.run_id, metrics, "metrics.json")


def finish_tracking(loggers) -> None:
    """Flush each logger and end the tracker's run: Lightning's W&B logger leaves the wandb run open, so that the next
    run in the same process (a test, a notebook) would log into it, and an offline run file would lack its end."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        logger.finalize("success")
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish()
