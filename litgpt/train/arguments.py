"""A training command's arguments: checked before anything heavy, and recorded with the run."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from litgpt.args import ActivationCheckpointing, EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.distributed.runtime import print_once
from litgpt.errors import UserError
from litgpt.io import atomic_write_text
from litgpt.preemption import slurm_job_id


def plain(value: Any) -> Any:
    """Arguments as YAML/JSON-friendly values; data modules as {class_path, init_args} like jsonargparse reads."""
    if isinstance(value, Config):
        return dataclasses.asdict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if isinstance(value, (TrainArgs, EvalArgs)):
            return fields
        return {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": fields}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def record_arguments(function: Callable, arguments: dict) -> dict:
    """The entry point's arguments in signature order, as plain values (written to hyperparameters.yaml)."""
    names = inspect.signature(function).parameters
    return {name: plain(arguments[name]) for name in names if name in arguments}


def write_run_args(out_dir: Path, hyperparameters: dict) -> None:
    record = {"command": [Path(sys.argv[0]).name, *sys.argv[1:]], "arguments": hyperparameters}
    atomic_write_text(Path(out_dir) / "run_args.json", json.dumps(record, indent=2, default=str) + "\n")


def check_seq_length(train: TrainArgs, config: Config) -> int:
    length = train.max_seq_length or config.block_size
    if length > config.block_size:
        raise UserError(
            f"--train.max_seq_length {length} is longer than the model's block size {config.block_size}: "
            f"use at most {config.block_size}."
        )
    if length < 1:
        raise UserError(f"--train.max_seq_length must be at least 1, got {length}.")
    return length


def check_limits(train: TrainArgs) -> None:
    for name in ("max_steps", "max_tokens", "epochs", "save_interval", "keep_last", "loss_chunk_size"):
        value = getattr(train, name)
        if value is not None and value < 1:
            raise UserError(f"--train.{name} must be at least 1, got {value}.")
    if train.log_interval < 1:
        raise UserError(f"--train.log_interval must be at least 1, got {train.log_interval}.")
    ActivationCheckpointing.parse(train.activation_checkpointing)  # a bad setting fails here, before Lightning loads


def check_requeue(train: TrainArgs) -> None:
    if train.requeue and slurm_job_id() is None:
        print_once("Note: --train.requeue acts only in a Slurm job; here a stop signal saves and stops the run.")


def load_logger(logger_name: str, out_dir: Path, run_name: str):
    from litgpt.loggers import build_logger

    return build_logger(logger_name, out_dir, run_name)


def default_tokenizer_dir(tokenizer_dir: Optional[Path], data, checkpoint_dir: Optional[Path]) -> Path:
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    if checkpoint_dir is not None:
        return Path(checkpoint_dir)
    bundled = getattr(data, "tokenizer_dir", None)
    if bundled is not None:
        return Path(bundled)
    raise UserError("Pretraining needs a tokenizer: pass --tokenizer_dir (a folder with tokenizer.json).")
