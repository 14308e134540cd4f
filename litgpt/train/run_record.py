"""What a run records of its command's arguments: hyperparameters.yaml (in every checkpoint) and run_args.json.
The arguments themselves and their checks are `litgpt.args`."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable

from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.io import atomic_write_text


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
