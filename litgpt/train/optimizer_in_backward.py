"""--train.optimizer_in_backward: each trainable parameter is updated inside the backward pass as soon as its gradient
is ready, and that gradient freed, so that the gradients of the whole model never exist at once.

Every parameter gets its own optimizer (the --optimizer class with its arguments), stepped by a post-accumulate-grad
hook. On one device autograd runs the hook once the parameter's gradient is complete; under FSDP2 `fully_shard` runs
it itself on the sharded parameter, once the reduce-scatter has given it its (averaged) sharded gradient.

`OptimizerInBackward` stands where the trainer expects an optimizer: the learning-rate schedule sets the lr of its
`param_groups` (every per-parameter optimizer's group), `step` and `zero_grad` find nothing left to do, and the
checkpoints save and restore it through torch.distributed.checkpoint's `get_optimizer_state_dict` and
`set_optimizer_state_dict`, which take a sequence of optimizers (it iterates over them) and key each state by its
parameter's name, whole or sharded, as they do the single optimizer.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Iterator

import torch

from litgpt.args import TrainArgs
from litgpt.errors import UserError
from litgpt.precision import Precision

OPTION = "--train.optimizer_in_backward"


class OptimizerInBackward:
    """One optimizer per trainable parameter, each stepped by a hook in the backward pass (see the module docstring).

    `build` makes an optimizer of one list of parameters (`litgpt.train.optimizer.build_optimizer`'s).
    """

    # No gradient is left after the backward pass: none to measure, clip or leave unapplied.
    steps_in_backward = True

    def __init__(self, build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 parameters: Iterable[torch.nn.Parameter]) -> None:
        trainable = [p for p in parameters if p.requires_grad]
        self.optimizers = [build([p]) for p in trainable]
        for parameter, optimizer in zip(trainable, self.optimizers):
            parameter.register_post_accumulate_grad_hook(step_and_free(optimizer))

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        """The group dicts the optimizers step with, so that the schedule's lr reaches them (read anew each time:
        loading a state replaces an optimizer's groups)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        """Every parameter's optimizer state, by parameter (as `torch.optim.Optimizer.state`)."""
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self) -> None:
        """Nothing to do: the backward pass stepped every parameter."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed once its parameter was stepped."""


def step_and_free(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """The hook of one parameter: step its optimizer, then drop the gradient, which nothing needs any more."""

    def hook(parameter: torch.Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return hook


def check_optimizer_in_backward(train: TrainArgs, optimizer_class: type, precision: Precision, accumulation: int,
                                extension_strategy: bool) -> None:
    """UserError for a run with --train.optimizer_in_backward that could not train as asked (before anything is
    written)."""
    if accumulation > 1:
        raise UserError(
            f"{OPTION} steps each parameter as soon as one micro-batch's gradient is ready, but this run accumulates "
            f"{accumulation} micro-batches per step: set --train.global_batch_size to --train.micro_batch_size x "
            "devices x num_nodes, or leave out the option."
        )
    if train.max_norm is not None:
        raise UserError(
            f"{OPTION} cannot clip the gradient norm (--train.max_norm {train.max_norm}): clipping needs every "
            "gradient at once, which this mode never holds. Pass --train.max_norm null, or leave out the option."
        )
    if train.on_nonfinite == "skip":
        raise UserError(
            f"{OPTION} applies each update during the backward pass, before a non-finite loss is known, so "
            "--train.on_nonfinite skip cannot skip it: use --train.on_nonfinite stop, or leave out the option."
        )
    if precision.scales_gradients:
        raise UserError(
            f"{OPTION} steps the scaled gradients of --precision {precision} before a gradient scaler could unscale "
            "or skip them: use bf16-mixed (or 32-true), or leave out the option."
        )
    if extension_strategy:
        raise UserError(f"{OPTION} runs with the core's strategies only (one device or FSDP2), not with a "
                        "--compiler extension: use --compiler none, torch or auto, or leave out the option.")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UserError(
            f"{OPTION} steps one parameter at a time without re-evaluating the loss, but --optimizer "
            f"{optimizer_class.__name__} needs a closure that does: choose another optimizer, or leave out the option."
        )
