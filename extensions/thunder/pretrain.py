"""Pretraining with the Thunder compiler: `python extensions/thunder/pretrain.py` (or `litgpt pretrain --compiler thunder`).

The same arguments as `litgpt pretrain`, the same recipe, loop (`litgpt.train.trainer.Trainer`) and checkpoint
manager; only the Fabric strategy differs: the model is compiled with `thunder.jit` and, on several
devices, sharded by Thunder's FSDP or replicated by its DDP. `--compiler torch|none` runs `litgpt pretrain` itself.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from litgpt.args import ActivationCheckpointing, EvalArgs, FSDPArgs, LogArgs, TrainArgs
from litgpt.config import Config
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName
from litgpt.pretrain import EVAL_DEFAULTS, TRAIN_DEFAULTS
from litgpt.pretrain import setup as core_setup


@dataclass
class ThunderArgs:
    """Thunder's FSDP (with --strategy fsdp on several devices).

    Args:
        sharding_strategy: ZERO3 (gather each parameter for the forward and again for the backward) or ZERO2 (keep it
            gathered in between: fewer all-gathers, more memory).
        bucketing_strategy: BLOCK, LAYER or NONE: how many parameters one collective carries (see the README).
        state_dict_type: full (one lit_model.pth) or sharded (every rank writes its shards).
        executors: Thunder executors by name (default: Thunder's own on a GPU; sdpa and torch on a CPU).
    """

    sharding_strategy: Literal["ZERO3", "ZERO2"] = "ZERO3"
    bucketing_strategy: Literal["BLOCK", "LAYER", "NONE"] = "BLOCK"
    state_dict_type: Literal["full", "sharded"] = "full"
    executors: Optional[list[str]] = None


def setup(
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    out_dir: Path = Path("out/pretrain"),
    precision: Optional[str] = None,
    initial_checkpoint_dir: Optional[Path] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TRAIN_DEFAULTS,
    eval: EvalArgs = EVAL_DEFAULTS,
    optimizer: Union[str, dict] = "AdamW",
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    tokenizer_dir: Optional[Path] = None,
    logger_name: LoggerName = "csv",
    seed: int = 42,
    profile: bool = False,
    compiler: Literal["thunder", "torch", "none"] = "thunder",
    strategy: Literal["auto", "fsdp", "ddp"] = "auto",
    thunder: ThunderArgs = ThunderArgs(),
    log: LogArgs = LogArgs(),
) -> None:
    """Pretrain a model compiled with Thunder (the arguments not listed are `litgpt pretrain`'s).

    Args:
        compiler: thunder; torch or none run `litgpt pretrain --compiler torch|none` (the --thunder.* options unused).
        strategy: On several devices: fsdp or auto shard with Thunder's FSDP (--thunder.*), ddp replicates with its
            DDP. On one device the model is compiled, nothing more.
        thunder: Thunder's FSDP options; --fsdp.timeout also applies, the other --fsdp.* options are FSDP2's.
    """
    if compiler != "thunder":
        arguments = {name: value for name, value in locals().items() if name != "thunder"}
        return core_setup(**arguments)

    from extensions.thunder.compat import import_thunder
    from litgpt.distributed.fabric import build_fabric
    from litgpt.pretrain import pretrain_job
    from litgpt.train.arguments import load_logger
    from litgpt.train.job import launch

    arguments = dict(locals())
    check_fsdp_args(fsdp)
    check_activation_checkpointing(train)
    import_thunder()  # here, before any process starts: a missing thunder is one message, not one per process
    job = pretrain_job(arguments, record_arguments_of=setup)
    logger = load_logger(logger_name, job.out_dir, run_name=f"pretrain-{job.recipe.config.name or 'model'}")
    fabric = build_fabric(devices, num_nodes, precision, loggers=[logger],
                          strategy_for_world=lambda world: thunder_strategy(world, strategy, thunder, fsdp.timeout))
    launch(fabric, job)


def check_fsdp_args(fsdp: FSDPArgs) -> None:
    defaults = FSDPArgs()
    for name in ("sharding_strategy", "state_dict_type", "cpu_offload", "forward_prefetch", "backward_prefetch"):
        if getattr(fsdp, name) != getattr(defaults, name):
            raise UserError(
                f"--fsdp.{name} configures PyTorch's FSDP, which --compiler thunder does not use: Thunder's FSDP "
                "takes --thunder.sharding_strategy ZERO3|ZERO2, --thunder.bucketing_strategy BLOCK|LAYER|NONE and "
                "--thunder.state_dict_type full|sharded (python extensions/thunder/pretrain.py)."
            )


def check_activation_checkpointing(train: TrainArgs) -> None:
    """Thunder's `torch.utils.checkpoint` ignores the selective policy (`context_fn`): `ops` would quietly recompute
    every block."""
    if ActivationCheckpointing.parse(train.activation_checkpointing).mode == "ops":
        raise UserError(
            "--train.activation_checkpointing ops is PyTorch's selective checkpointing, which Thunder ignores (it "
            "would recompute every block): with --compiler thunder use true, N or every:N, or use --compiler torch or "
            "none."
        )


def thunder_strategy(world_size: int, strategy: str, thunder: ThunderArgs, timeout: float):
    import torch

    from extensions.thunder.strategies import ThunderDDPStrategy, ThunderFSDPStrategy, ThunderSingleDeviceStrategy

    if world_size == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return ThunderSingleDeviceStrategy(device=device, executors=thunder.executors)
    if strategy == "ddp":
        return ThunderDDPStrategy(executors=thunder.executors, timeout=timeout)
    return ThunderFSDPStrategy(
        sharding_strategy=thunder.sharding_strategy,
        bucketing_strategy=thunder.bucketing_strategy,
        state_dict_type=thunder.state_dict_type,
        executors=thunder.executors,
        timeout=timeout,
    )


def run_from_command_line(argv: list[str]) -> None:
    """Parse the arguments like `litgpt pretrain` does; bad input prints one line and exits with code 1."""
    from litgpt.__main__ import run_cli

    if argv and not argv[0].startswith("-"):
        argv = ["--model_name", *argv]
    run_cli(setup, argv, prog="extensions/thunder/pretrain.py")


if __name__ == "__main__":
    run_from_command_line(sys.argv[1:])
