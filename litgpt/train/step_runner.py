"""How the forward and backward passes of a step's micro-batches run: the trainer hands a `StepRunner` the
micro-batches of one optimizer step and gets their losses back, and asks it for a validation micro-batch's losses;
it never learns how the model is laid out over the devices.

`MicroBatchLoop` runs one micro-batch after the other through the whole model, the backward pass of each right
after its forward (gradient accumulation). `PipelineSteps` hands them all to the pipeline schedule of this rank's
stages (`litgpt.distributed.pipeline`), which interleaves the stages' forward and backward passes over the devices of
the pipeline group; the recipe's loss runs on the last stage, and the losses reach every rank from there.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Protocol, Union

import torch
from torch import nn

from litgpt.checkpoint.manager import unwrap
from litgpt.data.base import pad_batch
from litgpt.distributed import pipeline as pipelining
from litgpt.moe import RouterStats, load_balancing_loss
from litgpt.train.loss import backward_in_parts, packed
from litgpt.train.objective import Batch, Losses, Objective


class StepRunner(Protocol):
    def train_step(self, batches: list[Batch]) -> Losses:
        """Run the forward and backward passes of one optimizer step's micro-batches (on the device), leaving the
        gradients of their mean loss for the optimizer; returns the loss and its parts, each the mean over the
        micro-batches, detached, the same on every rank of a model-parallel group."""

    def validation_losses(self, batch: Batch) -> Losses:
        """The validation loss and its parts of one micro-batch (on the device), without gradients."""

    def parameter_counts(self) -> tuple[int, int]:
        """The model's (trainable, all) parameters, wherever they are held."""


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of `model` (a sharded one's whole tensors)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class MicroBatchLoop:
    """Gradient accumulation over the whole model: each micro-batch's loss, divided by their number, is
    backpropagated right after its forward pass (the gradients synchronized after the last one only, where the
    strategy allows)."""

    def __init__(self, fabric, model: nn.Module, objective: Objective) -> None:
        self.fabric, self.model, self.objective = fabric, model, objective

    def train_step(self, batches: list[Batch]) -> Losses:
        fabric, count = self.fabric, len(batches)
        step_losses: Losses = {}
        for micro, batch in enumerate(batches):
            with fabric.no_backward_sync(self.model, enabled=micro < count - 1):
                with fabric.autocast():  # the loss applies the head outside the model's forward: same precision
                    losses = self.objective.train_loss(self.model, batch)
                fabric.backward(losses["loss"] / count)
            for name, value in losses.items():
                step_losses[name] = step_losses.get(name, 0.0) + value.detach().float() / count
        return step_losses

    def validation_losses(self, batch: Batch) -> Losses:
        with self.fabric.autocast():
            return self.objective.validation_loss(self.model, batch)

    def parameter_counts(self) -> tuple[int, int]:
        return parameter_counts(self.model)


class LastStageOutput:
    """The last pipeline stage as the recipe's loss sees a model: called on a batch's tokens for its final hidden
    states it gives the stage's output, it has the model's output head and config, and its routers' load-balancing
    loss comes from the routing statistics the stages passed along (`StageModule.router_stats_so_far`). So every
    recipe's loss (the chunked head, a LoRA head, a teacher run on the batch's tokens) runs on the last stage
    unchanged."""

    def __init__(self, stage: nn.Module, output: Union[torch.Tensor, tuple[torch.Tensor, ...]]) -> None:
        self.lm_head, self.config = stage.lm_head, stage.config
        self.hidden, *self.router_stats = output if isinstance(output, tuple) else (output,)

    def router_aux_loss(self) -> Optional[torch.Tensor]:
        """Every MoE layer's load-balancing loss together, as `GPT.router_aux_loss` gives it; None without one."""
        if not self.router_stats:
            return None
        probability, counts = self.router_stats
        return load_balancing_loss(self.config, [RouterStats(counts[:-1], probability, counts[-1])])

    def __call__(self, input_ids: torch.Tensor, return_hidden: bool = False, **kwargs) -> torch.Tensor:
        if not return_hidden:
            raise RuntimeError("A pipeline's last stage gives the final hidden states, for a loss that applies the "
                               "head itself.")
        return self.hidden


class PipelineSteps:
    """A step's micro-batches through this rank's stages by the pipeline schedule (`n_microbatches` of them, each
    right-padded to `seq_length` positions rounded up to a multiple of the tensor x context-parallel degrees: the
    stages exchange tensors of one declared shape, split over the sequence by both). Each micro-batch's tensors travel
    to the last stage as the schedule's target (stacked along a new dimension 1), where the recipe's loss reads them
    back as a batch."""

    def __init__(self, fabric, model: nn.Module, objective: Objective, n_microbatches: int, micro_batch_size: int,
                 seq_length: int) -> None:
        self.fabric, self.objective = fabric, objective
        self.model = unwrap(model)
        self.pipeline = self.model.pipeline
        self.context = getattr(fabric.strategy, "context_parallel", None)
        self.context_size = 1 if self.context is None else self.context.size
        multiple = self.model.sequence_shards * self.context_size
        self.seq_length = seq_length + -seq_length % multiple
        self.last_stage = next((stage for stage in self.model.stages if stage.is_last), None)
        self.schedule = pipelining.build_schedule(
            self.model, n_microbatches, (micro_batch_size, self.seq_length // self.context_size), self.loss)
        self.names: list[str] = []  # the batch's tensors, in their order along the target's dimension 1
        self.recorded: list[Losses] = []  # this step's losses of each micro-batch, on the last stage

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        batch = {name: target[:, index] for index, name in enumerate(self.names)}
        # A zero-bubble schedule differentiates the loss twice: the inputs' gradients, later the weights'.
        in_parts = backward_in_parts() if "ZeroBubble" in self.pipeline.schedule else contextlib.nullcontext()
        with in_parts:
            losses = self.objective.train_loss(LastStageOutput(self.last_stage, output), batch)
        self.recorded.append({name: value.detach().float() for name, value in losses.items()})
        return losses["loss"]

    def train_step(self, batches: list[Batch]) -> Losses:
        counted = self.counted_positions([batch["input_ids"].shape for batch in batches], self.seq_length)
        batches = [pad_batch(batch, self.seq_length) for batch in batches]
        self.names = list(batches[0])
        whole = {name: torch.cat([batch[name] for batch in batches]) for name in self.names}
        target = torch.stack([whole[name] for name in self.names], dim=1)
        self.recorded = []
        with self.fabric.autocast():
            input_ids, positions = self.stage_inputs(whole)
            self.schedule.step(input_ids, target=target, **packed(positions), **counted)
        if self.model.tie is not None:
            self.model.tie.add_copy_gradient()
        means = None
        if self.last_stage is not None:
            means = {name: torch.stack([losses[name] for losses in self.recorded]).mean()
                     for name in self.recorded[0]}
        return self.pipeline.from_last_stage(means, "train")

    def validation_losses(self, batch: Batch) -> Losses:
        losses: Optional[Losses] = None
        with self.fabric.autocast():
            length = batch["input_ids"].size(1)
            padded = length + -length % (self.model.sequence_shards * self.context_size)
            counted = self.counted_positions([batch["input_ids"].shape], padded)
            batch = pad_batch(batch, padded)
            input_ids, positions = self.stage_inputs(batch)
            hidden = pipelining.forward(self.model, input_ids, **packed(positions), **counted)
            if hidden is not None:
                losses = self.objective.validation_loss(LastStageOutput(self.last_stage, hidden), batch)
        return self.pipeline.from_last_stage(losses, "validation")

    def counted_positions(self, shapes: list[torch.Size], padded: int) -> dict[str, torch.Tensor]:
        """The stages' `counted_positions` for micro-batches of `shapes` (rows, positions) before their padding to
        `padded` positions, where the routers' load-balancing loss reads the routing (one process pads a batch to its
        longest sample only); {} elsewhere."""
        if not self.model.stages[0].carries_router_stats:
            return {}
        local = padded // self.context_size
        counts = []
        for rows, length in shapes:
            counted = length if self.context is None else self.context.counted_positions(length, padded)
            counts += [local if counted is None else counted] * rows
        return {"counted_positions": torch.tensor(counts, device=self.pipeline.device)}

    def stage_inputs(self, batch: Batch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The token ids and packed positions the first stage reads: under context parallelism this rank's slice of
        the positions (`ContextParallel.local_batch`). The loss still reads the whole batch (the schedule's target):
        the context-parallel objective slices its labels the same way."""
        if self.context is None:
            return batch["input_ids"], batch.get("positions")
        input_ids, _, positions = self.context.local_batch(batch["input_ids"], batch["labels"], batch.get("positions"))
        return input_ids, positions

    def parameter_counts(self) -> tuple[int, int]:
        """Every stage's: this rank's stages' counts summed over the pipeline group."""
        counts = torch.tensor(parameter_counts(self.model), device=self.pipeline.device)
        copy = None if self.model.tie is None else self.model.tie.embedding
        if copy is not None:  # one process counts the tied weight once
            counts -= torch.tensor([copy.numel() if copy.requires_grad else 0, copy.numel()], device=counts.device)
        torch.distributed.all_reduce(counts, group=self.pipeline.group)
        trainable, total = counts.tolist()
        return trainable, total


def step_runner(fabric, model: nn.Module, objective: Objective, n_microbatches: int, micro_batch_size: int,
                seq_length: int) -> StepRunner:
    """The runner for `model` as it was set up: the pipeline schedule for a pipeline rank's stages, else the loop."""
    if pipelining.pipeline_of(unwrap(model)) is not None:
        return PipelineSteps(fabric, model, objective, n_microbatches, micro_batch_size, seq_length)
    return MicroBatchLoop(fabric, model, objective)
