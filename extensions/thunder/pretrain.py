"""Thunder as a litgpt compiler extension (`ThunderCompiler`, registered under `litgpt.compilers` as `thunder`), and
its pretraining entry point: `python extensions/thunder/pretrain.py` takes `litgpt pretrain`'s arguments plus
`--thunder.*`.

Any training command with `--compiler thunder` (pretrain, finetune_full, finetune_lora, distill) builds its job as
always and hands it to `ThunderCompiler`: it checks what Thunder cannot run and gives the Fabric strategy, which
compiles the model with `thunder.jit` and, on several devices, shards it with Thunder's FSDP or replicates it with its
DDP. The recipe, loop (`litgpt.train.trainer.Trainer`) and checkpoint manager are litgpt's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

from litgpt.args import ActivationCheckpointing, FSDPArgs, TrainArgs
from litgpt.errors import UserError
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


@dataclass
class ThunderCompiler:
    """`litgpt.registry.CompilerExtension` for Thunder, with its options (`--compiler thunder` takes the defaults)."""

    options: ThunderArgs = field(default_factory=ThunderArgs)

    def check(self, job, fsdp: FSDPArgs) -> None:
        """Refuse what Thunder cannot run, and a missing thunder, before any process starts (one message, not one
        per process)."""
        from extensions.thunder.compat import import_thunder

        check_fsdp_args(fsdp)
        check_activation_checkpointing(job.train)
        import_thunder()

    def strategy(self, world_size: int, strategy: str, timeout: float):
        return thunder_strategy(world_size, strategy, self.options, timeout)


def setup(compiler: Literal["thunder", "torch", "none"] = "thunder", thunder: ThunderArgs = ThunderArgs(),
          **pretrain_arguments) -> None:
    """Pretrain a model compiled with Thunder: `litgpt pretrain`'s arguments, plus Thunder's FSDP options.

    Args:
        compiler: thunder; torch or none run `litgpt pretrain --compiler torch|none` (the --thunder.* options unused).
        thunder: Thunder's FSDP options; --fsdp.timeout also applies, the other --fsdp.* options are FSDP2's.
    """
    core_setup(compiler=ThunderCompiler(thunder) if compiler == "thunder" else compiler, **pretrain_arguments)


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
